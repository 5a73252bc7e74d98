"""Tokenizers the preprocessor can use: a byte-level default and a local Hugging Face `tokenizer.json`.

Every tokenizer exposes the same small surface (encode, decode, eos/pad ids, vocab size) and an `identity()` that is
written into the dataset's meta.json, so a dataset can never be read back with a tokenizer that did not produce it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or used; the message names the file and the fix."""


BYTE_EOS = 256
BYTE_PAD = 257
BYTE_VOCAB = 258

# Special tokens looked up, in order, when a tokenizer.json does not say which one ends a document.
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]", "<|im_end|>")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def identity(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 ends a document, 257 pads. Needs no files, so every machine can run it."""

    vocab_size: int = BYTE_VOCAB
    eos_id: int = BYTE_EOS
    pad_id: int = BYTE_PAD

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        # Special ids carry no text; a split multi-byte character decodes to U+FFFD instead of failing.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def identity(self) -> dict[str, Any]:
        return {"kind": "byte", "vocab_size": self.vocab_size, "eos_id": self.eos_id, "pad_id": self.pad_id}


@dataclass
class HFTokenizer:
    """A local `tokenizer.json` read with the `tokenizers` library (no network, no `transformers`)."""

    path: Path
    vocab_size: int = 0
    eos_id: int = 0
    pad_id: int = 0
    sha256: str = ""
    _tok: Any = field(default=None, repr=False)

    @classmethod
    def load(cls, path: str | Path) -> "HFTokenizer":
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"tokenizer file {path} does not exist; set `data.tokenizer` to a tokenizer.json path or \"byte\"")
        try:
            import tokenizers
        except ImportError:
            raise TokenizerError(f"`data.tokenizer={path}` needs the `tokenizers` package: "
                            "`.venv/bin/pip install tokenizers` (or use data.tokenizer=byte)") from None
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception for malformed files
            raise TokenizerError(f"tokenizer file {path} is not a valid tokenizer.json: {e}") from None
        eos = _first_present(tok, _EOS_NAMES)
        if eos is None:
            raise TokenizerError(f"tokenizer {path} has none of the end-of-document tokens {list(_EOS_NAMES)}; "
                            "add one as a special token to the tokenizer.json")
        pad = _first_present(tok, _PAD_NAMES)
        # Without a pad token the EOS id pads: padded positions carry label -100 and their own segment, so the
        # id they hold never reaches the loss or another document's attention.
        pad = eos if pad is None else pad
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        return cls(path=path, vocab_size=tok.get_vocab_size(with_added_tokens=True), eos_id=eos, pad_id=pad,
                   sha256=digest, _tok=tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def identity(self) -> dict[str, Any]:
        # The content hash, not the path, identifies the tokenizer: a copied file is the same tokenizer.
        return {"kind": "hf", "sha256": self.sha256, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "pad_id": self.pad_id}


def _first_present(tok: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        idx = tok.token_to_id(name)
        if idx is not None:
            return idx
    return None


def load_tokenizer(spec: str) -> Tokenizer:
    """`spec` is "byte" or a path to a tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer.load(spec)
