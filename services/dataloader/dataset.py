"""The tokenized corpus on disk, read through memory maps.

Layout of a dataset directory (written by `preprocess.py`):
  tokens.bin  every document's token ids back to back (uint16 when the vocabulary fits, else uint32), EOS closing each
  index.npy   int64 offsets into tokens.bin, one per document plus the end: document i is tokens[off[i]:off[i+1]]
  loss_mask.bin  only for a corpus with prompt/completion records: one uint8 per token, 1 where the token is a
              training target (a completion's tokens and its EOS), 0 where it only conditions (a prompt's); meta.json's
              "loss_mask" says it is there
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
LOSS_MASK_FILE = "loss_mask.bin"
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
        self.tokens = self._map(TOKENS_FILE, self.dtype)
        # Which tokens are training targets; None: every one (a plain corpus)
        self.loss_mask = self._map(LOSS_MASK_FILE, np.dtype(np.uint8)) if self.meta.get("loss_mask") else None

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

    def _map(self, name: str, dtype: np.dtype) -> np.ndarray:
        """One value per token of file `name`, memory-mapped, after checking its size against meta.json."""
        path = self.path / name
        want = self.num_tokens * dtype.itemsize
        have = path.stat().st_size if path.is_file() else -1
        if have != want:
            raise DataError(f"{path} has {have} bytes, {META_FILE} promises {want}: it is truncated or was replaced; "
                            "preprocess again")
        return np.memmap(path, dtype=dtype, mode="r", shape=(self.num_tokens,))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    def doc_targets(self, i: int) -> np.ndarray | None:
        """Document i's loss mask (bool per token: a training target), or None where every token is one."""
        return None if self.loss_mask is None else self.loss_mask[self.offsets[i]:self.offsets[i + 1]].astype(bool)

    @cached_property
    def prompted(self) -> np.ndarray:
        """Per document, whether it holds a prompt (a token that is no training target): a fine-tuning example."""
        if self.loss_mask is None or len(self) == 0:
            return np.zeros(len(self), dtype=bool)
        return np.minimum.reduceat(self.loss_mask, self.offsets[:-1]) == 0

    def packed_lengths(self, seq_len: int) -> np.ndarray:
        """The documents' lengths as packing takes them: an example longer than a sequence of `seq_len` positions is
        cut to its first `seq_len` (split instead, its later pieces would train without its prompt); packing splits
        any other document that long into consecutive pieces."""
        return np.where(self.prompted & (self.doc_lengths > seq_len + 1), seq_len + 1, self.doc_lengths)

    def examples_over(self, seq_len: int) -> int:
        """How many examples `packed_lengths` cuts."""
        return int(np.count_nonzero(self.packed_lengths(seq_len) != self.doc_lengths))

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
        """Content hash of the token file (and loss mask): a stream state is only valid against the same tokens."""
        mask = self.meta.get("loss_mask_sha256")
        return str(self.meta["tokens_sha256"]) + (f"/{mask}" if mask else "")
