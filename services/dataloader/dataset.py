"""The tokenized corpus on disk, read through memory maps.

Layout of a dataset directory (written by `preprocess.py`):
  tokens.bin  every document's token ids back to back (uint16 when the vocabulary fits, else uint32), EOS closing each
  index.npy   int64 offsets into tokens.bin, one per document plus the end: document i is tokens[off[i]:off[i+1]]
  meta.json   tokenizer identity, counts, dtype and source checksums; written last, so its presence means the other
              two files are complete
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from services.dataloader.errors import DataError

TOKENS_FILE = "tokens.bin"
INDEX_FILE = "index.npy"
META_FILE = "meta.json"
FORMAT_VERSION = 1


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def read_meta(path: Path) -> dict[str, Any]:
    meta_path = Path(path) / META_FILE
    if not meta_path.is_file():
        raise DataError(f"no dataset at {path} ({META_FILE} missing): run "
                        "`python -m services.dataloader.preprocess --config FILE`")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{meta_path} is corrupt ({e}); delete {path} and preprocess again") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{meta_path} is not a format-{FORMAT_VERSION} dataset; delete {path} and preprocess again")
    return meta


class IndexedDataset:
    """Documents of a preprocessed corpus; `doc(i)` is a zero-copy view of document i's tokens (EOS included)."""

    def __init__(self, path: str | Path, expect_tokenizer: dict[str, Any] | None = None):
        self.path = Path(path)
        self.meta = read_meta(self.path)
        if expect_tokenizer is not None and self.meta["tokenizer"] != expect_tokenizer:
            raise DataError(f"dataset {self.path} was tokenized with {self.meta['tokenizer']} but the configured "
                            f"tokenizer is {expect_tokenizer}; preprocess again (`data.dataset_dir` of its own) "
                            "or set `data.tokenizer` to the one that built it")
        self.dtype = np.dtype(self.meta["dtype"])
        self.num_tokens = int(self.meta["num_tokens"])
        self.offsets = self._read_index(int(self.meta["num_docs"]))
        self.tokens = self._map_tokens()

    def _read_index(self, num_docs: int) -> np.ndarray:
        index_path = self.path / INDEX_FILE
        try:
            offsets = np.load(index_path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise DataError(f"document index {index_path} is missing or truncated ({e}); preprocess again") from None
        ok = (offsets.ndim == 1 and offsets.dtype == np.int64 and len(offsets) == num_docs + 1 and offsets[0] == 0
              and offsets[-1] == self.num_tokens and bool(np.all(np.diff(offsets) > 0)))
        if not ok:
            raise DataError(f"document index {index_path} does not match {META_FILE} ({num_docs} documents, "
                            f"{self.num_tokens} tokens); the dataset is corrupt: preprocess again")
        return offsets

    def _map_tokens(self) -> np.ndarray:
        tokens_path = self.path / TOKENS_FILE
        want = self.num_tokens * self.dtype.itemsize
        have = tokens_path.stat().st_size if tokens_path.is_file() else -1
        if have != want:
            raise DataError(f"token file {tokens_path} has {have} bytes, {META_FILE} promises {want}: "
                            "it is truncated or was replaced; preprocess again")
        return np.memmap(tokens_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    @cached_property
    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def eos_id(self) -> int:
        return int(self.meta["tokenizer"]["eos_id"])

    @property
    def pad_id(self) -> int:
        return int(self.meta["tokenizer"]["pad_id"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["tokenizer"]["vocab_size"])

    @property
    def fingerprint(self) -> str:
        """Content hash of the token file: a stream state is only valid against the same tokens."""
        return str(self.meta["tokens_sha256"])
