"""Tokenizers: the byte-level default and a local HF tokenizer.json round-trip text and name their special ids."""

from __future__ import annotations

import pytest

from services.common.tokenizer import BYTE_EOS, BYTE_PAD, BYTE_VOCAB, ByteTokenizer, TokenizerError, load_tokenizer

TEXT = "Grüße, 世界! tabs\tand\nnewlines — and an emoji 🦀."


def test_byte_tokenizer_round_trips_any_unicode_text():
    tok = load_tokenizer("byte")
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8"))
    assert tok.decode(ids) == TEXT


def test_byte_tokenizer_special_ids_fit_the_default_model_vocab():
    tok = ByteTokenizer()
    assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (BYTE_EOS, BYTE_PAD, BYTE_VOCAB) == (256, 257, 258)
    from services.common.config import ModelConfig
    assert tok.vocab_size <= ModelConfig().vocab_size
    assert tok.decode([*tok.encode("ab"), tok.eos_id, tok.pad_id]) == "ab"  # special ids carry no text


def _write_hf_tokenizer(path, specials=("<|endoftext|>", "<pad>"), vocab_size=300):
    tokenizers = pytest.importorskip("tokenizers", reason="the HF tokenizer path needs the `tokenizers` package")
    from tokenizers import models, pre_tokenizers, trainers, decoders

    tok = tokenizers.Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT * 3, "the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.save(str(path))
    return path


def test_hf_tokenizer_json_round_trips_and_finds_eos_and_pad(tmp_path):
    path = _write_hf_tokenizer(tmp_path / "tokenizer.json")
    tok = load_tokenizer(str(path))
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.eos_id == 0 and tok.pad_id == 1  # special tokens come first in training order
    assert tok.identity()["kind"] == "hf" and len(tok.identity()["sha256"]) == 64


def test_hf_tokenizer_identity_is_its_content_not_its_path(tmp_path):
    a = _write_hf_tokenizer(tmp_path / "a.json")
    b = tmp_path / "b.json"
    b.write_bytes(a.read_bytes())
    assert load_tokenizer(str(a)).identity() == load_tokenizer(str(b)).identity()


def test_hf_tokenizer_without_pad_token_pads_with_eos(tmp_path):
    tok = load_tokenizer(str(_write_hf_tokenizer(tmp_path / "t.json", specials=("</s>",))))
    assert tok.pad_id == tok.eos_id


def test_hf_tokenizer_without_end_of_document_token_is_rejected(tmp_path):
    path = _write_hf_tokenizer(tmp_path / "t.json", specials=("<unk>",))
    with pytest.raises(TokenizerError, match="end-of-document"):
        load_tokenizer(str(path))


def test_missing_or_malformed_tokenizer_file_names_the_path(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        load_tokenizer(str(bad))
