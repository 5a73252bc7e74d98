"""Prompt/completion data (supervised fine-tuning): only the completions are trained on.

Specification: a `.jsonl` record (or `.parquet` row) with "prompt" and "completion" is one document, the prompt's
tokens then the completion's and EOS; the dataset's loss mask marks the prompt's tokens as no targets (tokens of plain
texts, in the same or earlier files, are targets); a micro-batch gives every position whose next token is a prompt
token label -100, also in the pieces of a document split across sequences, so the step's loss tokens are the
completions' and EOS's alone; a corpus without such records has no mask, and its stream identity is what it was; two
datasets of the same tokens with different masks are different streams; an example longer than a sequence is cut to
its first seq_len positions (counted, the dataloader warns), never split (its later pieces would lack the prompt),
while other documents are split as before; a record with neither form is refused naming file and line.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from services.dataloader.dataset import LOSS_MASK_FILE, IndexedDataset
from services.dataloader.errors import DataError
from services.dataloader.packing import Piece, split_document
from services.dataloader.preprocess import preprocess
from services.dataloader.stream import build_micro_batch
from services.trainer.step import count_loss_tokens

RECORDS = [{"prompt": "Q: 2+2=", "completion": " 4"}, {"text": "plain text, all of it trained on"},
           {"prompt": "", "completion": "no prompt"}, {"prompt": "Translate: chat", "completion": " cat"},
           {"prompt": "nothing to learn", "completion": "  "}]  # the last has no completion: not a document


def build(tmp_path, records, name="sft.jsonl", extra=()) -> IndexedDataset:
    path = tmp_path / name
    tmp_path.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return IndexedDataset(preprocess([*map(str, extra), str(path)], "byte", tmp_path / "ds", progress=False))


def expected_targets(record) -> list[bool]:
    """Per token of the record's document: a training target?"""
    if "text" in record:
        return [True] * (len(record["text"].encode()) + 1)
    return [False] * len(record["prompt"].encode()) + [True] * (len(record["completion"].encode()) + 1)


def test_records_become_documents_whose_prompt_tokens_are_no_targets(tmp_path):
    ds = build(tmp_path, RECORDS)
    kept = RECORDS[:4]
    assert len(ds) == 4 and ds.meta["loss_mask"] is True
    for i, r in enumerate(kept):
        text = r["text"] if "text" in r else r["prompt"] + r["completion"]
        assert bytes(ds.doc(i)[:-1].tolist()).decode() == text and ds.doc(i)[-1] == 256
        assert ds.doc_targets(i).tolist() == expected_targets(r)


def test_a_plain_corpus_has_no_mask_and_the_stream_identity_it_had(tmp_path):
    ds = build(tmp_path, [{"text": "only text"}, {"text": "and more text"}])
    assert ds.loss_mask is None and ds.doc_targets(0) is None and "loss_mask" not in ds.meta
    assert not (ds.path / LOSS_MASK_FILE).exists()
    assert ds.fingerprint == ds.meta["tokens_sha256"]  # states saved before masks existed still resume


def test_the_texts_of_files_before_the_first_prompted_one_are_targets(tmp_path):
    first = tmp_path / "a.txt"
    first.write_text("an earlier plain file")
    ds = build(tmp_path, RECORDS[:1], extra=[first])
    assert ds.doc_targets(0).all() and ds.doc_targets(1).tolist() == expected_targets(RECORDS[0])
    assert len(ds.loss_mask) == ds.num_tokens


def test_a_rebuild_without_prompted_records_drops_the_mask(tmp_path):
    assert build(tmp_path, RECORDS).loss_mask is not None
    ds = build(tmp_path, [{"text": "now plain"}])
    assert ds.loss_mask is None and not (ds.path / LOSS_MASK_FILE).exists()


@pytest.mark.parametrize("seq_len", [64, 8])  # 8: documents split into pieces sharing a boundary token
def test_micro_batch_labels_skip_prompt_tokens_and_the_loss_counts_completions(tmp_path, seq_len):
    ds = build(tmp_path, RECORDS)
    pieces = [p for i in range(len(ds)) for p in split_document(i, len(ds.doc(i)), seq_len)]
    sequences = [[p] for p in pieces]  # one piece a sequence: every split shows
    mb = build_micro_batch([ds], sequences, seq_len)
    labels = mb.tensors["labels"].numpy().reshape(len(sequences), seq_len)
    for row, piece in zip(labels, pieces):
        doc, targets = ds.doc(piece.doc), ds.doc_targets(piece.doc)
        want = [int(doc[j]) if targets[j] else -100 for j in range(piece.start + 1, piece.end)]
        assert row[:piece.positions].tolist() == want
        assert (row[piece.positions:] == -100).all()
    completions = sum(sum(expected_targets(r)[1:]) for r in RECORDS[:4])  # a document's first token is no label
    assert count_loss_tokens([mb.tensors]) == completions  # what the step's loss is divided by


def test_the_same_tokens_under_another_mask_are_another_stream(tmp_path):
    a = build(tmp_path / "a", [{"prompt": "ab", "completion": "cd"}])
    b = build(tmp_path / "b", [{"prompt": "a", "completion": "bcd"}])
    assert a.meta["tokens_sha256"] == b.meta["tokens_sha256"] and a.fingerprint != b.fingerprint


def test_an_example_longer_than_a_sequence_is_cut_to_its_first_positions_and_other_documents_are_split(tmp_path):
    from services.common.config import load_config
    from services.dataloader.heldout import eval_sequences
    from services.dataloader.stream import StepStream

    ds = build(tmp_path, RECORDS)  # documents of 10, 33, 10 and 20 tokens (9, 32, 9 and 19 positions)
    assert ds.examples_over(64) == 0 and ds.packed_lengths(64).tolist() == [10, 33, 10, 20]
    assert ds.examples_over(9) == 1  # the text (32 positions) is no example; "Translate: chat cat" (19) is
    assert ds.examples_over(8) == 2  # and "Q: 2+2= 4" (9); "no prompt" has none to lose
    assert ds.packed_lengths(8).tolist() == [9, 33, 10, 9]  # examples cut to 8 positions; the others whole
    cfg = load_config(None, ["data.seq_len=8", "data.micro_batch_size=1", "data.grad_accum=1",
                             "data.eval_fraction=0", "run.eval_interval=0"])
    stream = StepStream([ds], cfg.data, dp_size=1)
    pieces = set()
    while stream.epoch == 0:  # a whole epoch (and maybe a sequence of the next)
        pieces |= {(p.doc, p.start, p.end) for p in stream.sequences.next()}
    assert {p for p in pieces if p[0] in (0, 3)} == {(0, 0, 9), (3, 0, 9)}  # one piece each, from the prompt on
    assert {p for p in pieces if p[0] == 1} == {(1, 0, 9), (1, 8, 17), (1, 16, 25), (1, 24, 33)}  # text: split
    held = eval_sequences([ds], load_config(None, ["data.seq_len=8", "data.micro_batch_size=1", "data.eval_micro_batches=8",
                                                   "data.eval_fraction=0"]).data, whole=True)
    assert {(p.doc, p.start, p.end) for seqs in held for seq in seqs for p in seq if p.doc in (0, 3)} == \
        {(0, 0, 9), (3, 0, 9)}  # held-out evaluation packs the same way


def test_a_record_of_neither_form_names_file_and_line(tmp_path):
    with pytest.raises(DataError, match=r"sft.jsonl:2 has neither .*keys: \[.prompt.\]"):
        build(tmp_path, [RECORDS[0], {"prompt": "no completion"}])


def test_parquet_prompt_completion_rows(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="parquet needs pyarrow (not a test dependency)")
    import pyarrow.parquet as pq

    kept = [RECORDS[0], RECORDS[3]]
    pq.write_table(pa.Table.from_pylist(kept), tmp_path / "sft.parquet")
    ds = IndexedDataset(preprocess([str(tmp_path / "sft.parquet")], "byte", tmp_path / "ds", progress=False))
    assert [ds.doc_targets(i).tolist() for i in range(len(ds))] == [expected_targets(r) for r in kept]


def test_a_step_of_prompts_alone_trains_on_nothing_rather_than_dividing_by_zero():
    """A step whose every label is -100 (prompts cut from their completions by packing): loss 0, gradients finite."""
    from types import SimpleNamespace

    import torch

    from services.common.config import load_config
    from services.trainer.model.transformer import MoETransformer
    from services.trainer.optim import build_adamw
    from services.trainer.train import train_step

    cfg = load_config("configs/tiny.yaml", ["model.num_layers=1"])
    model = MoETransformer(cfg.model)
    model.init_weights(seed=0)
    batch = {"tokens": torch.arange(16) % 200, "labels": torch.full((16,), -100), "position_ids": torch.arange(16),
             "cu_seqlens": torch.tensor([0, 16], dtype=torch.int32)}
    rt = SimpleNamespace(world_size=1, device=torch.device("cpu"), autocast_dtype=None)
    values = train_step(model, build_adamw(model, cfg.optimizer), [batch], 1e-3, cfg, rt, groups=None).read()
    assert int(values["step_tokens"]) == 0 and float(values["loss_sum"]) == 0.0
    assert math.isfinite(float(values["grad_norm"]))  # the routers' aux loss still has a gradient; no NaN with it
