"""The held-out split and the evaluation set (services/dataloader/heldout.py), in the stream, the engine and the service.

Specification: `data.eval_fraction` of each dataset's documents never reach the training stream and every other one
does; the evaluation set packs held-out documents only, each at most once, the same set every time; dp rank r receives
micro-batches r, r + dp, ... of it, sized for the layout's largest CP group; asking for it over ZMQ between steps
leaves the training stream as it was; a service killed and restarted serves the same set to the client that asked; a
state saved with another split is refused, naming it.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from services.common.config import ConfigError, load_config
from services.dataloader.client import DataClient
from services.dataloader.dataset import IndexedDataset
from services.dataloader.engine import Engine
from services.dataloader.errors import DataError
from services.dataloader.heldout import eval_sequences, split_documents
from services.dataloader.preprocess import dataset_paths, ensure_dataset, eval_dataset_path
from services.dataloader.server import DataLoaderServer
from services.dataloader.stream import StepStream, build_micro_batch
from tests import test_dataloader_restart as restart
from tests.test_dataloader_service import registry, same  # noqa: F401

FRACTION = 0.1  # 12 of the corpus's 122 documents: 53 sequences of 64 tokens, the set takes 16


EVAL = [f"data.eval_fraction={FRACTION}", "data.eval_micro_batches=8", "run.eval_interval=5"]


def overrides(tmp_path, *extra):
    return restart.overrides(tmp_path, *EVAL, *extra)


def config(tmp_path, *extra):
    return load_config(None, overrides(tmp_path, *extra))


def dataset(cfg) -> IndexedDataset:
    ensure_dataset(cfg)
    return IndexedDataset(dataset_paths(cfg)[0])


def docs_of(sequences) -> list[int]:
    return [piece.doc for seq in sequences for piece in seq]


def test_the_split_is_a_fixed_partition_of_the_documents():
    train, held = split_documents(1000, 0.05, seed=3)
    assert len(held) == 50 and len(train) == 950
    assert sorted(np.concatenate([train, held]).tolist()) == list(range(1000))
    again = split_documents(1000, 0.05, seed=3)
    assert np.array_equal(again[1], held)
    assert not np.array_equal(split_documents(1000, 0.05, seed=4)[1], held)  # the seed draws it
    assert len(split_documents(10, 0.01, seed=3)[1]) == 1  # at least one document when anything is held out
    train, held = split_documents(10, 0.0, seed=3)
    assert train.tolist() == list(range(10)) and len(held) == 0
    with pytest.raises(DataError, match="leaving none to train on"):
        split_documents(3, 0.9, seed=3)


def test_held_out_documents_never_reach_the_training_stream_and_every_other_one_does(tmp_path):
    cfg = config(tmp_path)
    d = dataset(cfg)
    train, held = split_documents(len(d), FRACTION, cfg.data.seed)
    stream = StepStream([d], cfg.data, dp_size=1)
    seen = set()
    while stream.epoch == 0:  # a whole epoch
        seen.update(docs_of([stream.sequences.next()]))
    assert seen <= set(train.tolist())
    assert {int(i) for i in train if d.doc_lengths[i] > 1} <= seen  # (a one-token document has nothing to predict)
    assert held.size and not seen & set(held.tolist())


def test_without_a_held_out_fraction_the_training_stream_is_unchanged(tmp_path):
    """data.eval_fraction=0 packs what the stream packed before the split existed: every document, in its order."""
    from services.dataloader.packing import PackedSequences

    cfg = load_config(None, overrides(tmp_path, "data.eval_fraction=0", "run.eval_interval=0"))
    d = dataset(cfg)
    before = PackedSequences(d.doc_lengths, cfg.data.seq_len, cfg.data.packing_window, cfg.data.seed)
    before.reset(None)
    stream = StepStream([d], cfg.data, dp_size=1)
    for _ in range(200):
        assert stream.sequences.next() == before.next()
    assert "eval_fraction" not in stream.state()  # states saved before the split resume unchanged


def test_the_evaluation_set_packs_held_out_documents_only_and_each_once(tmp_path):
    cfg = config(tmp_path)
    d = dataset(cfg)
    held = set(split_documents(len(d), FRACTION, cfg.data.seed)[1].tolist())
    chunks = eval_sequences([d], cfg.data)
    assert len(chunks) == 8 and all(len(c) == 2 for c in chunks)
    pieces = [(p.doc, p.start) for c in chunks for seq in c for p in seq]
    assert {doc for doc, _ in pieces} <= held and len(set(pieces)) == len(pieces)
    assert eval_sequences([d], cfg.data) == chunks
    cfg.data.eval_micro_batches = 100
    with pytest.raises(DataError, match="pack into 53 sequences.*raise eval_fraction or lower eval_micro_batches"):
        eval_sequences([d], cfg.data)


def test_dp_ranks_share_the_set_in_turn_sized_for_the_largest_cp_group(tmp_path):
    cfg = config(tmp_path, "parallel.cp=2")
    d = dataset(cfg)
    engine = Engine([d], cfg.data, cp_sizes=[1, 2])
    whole = engine.eval_set
    assert len(whole) == 8
    for dp in (1, 2, 4):
        for r in range(dp):
            share = engine.eval_share(r, dp)
            assert [h.micro for h, _ in share] == list(range(8 // dp))
            assert all(h.grad_accum == 8 // dp and h.cp_size == 2 and h.dp_rank == r for h, _ in share)
            assert all(same(t, mb.tensors) for (_, t), mb in zip(share, whole[r::dp], strict=True))
            assert all(h.real_tokens == int((t["labels"] != -100).sum()) for h, t in share)
    with pytest.raises(DataError, match="not a multiple of the trainer's data-parallel size 3"):
        engine.eval_share(0, 3)
    with pytest.raises(DataError, match="outside"):
        engine.eval_share(2, 2)
    replica = Engine([d], load_config(None, overrides(tmp_path, "data.replicas=2")).data, replica=1)
    assert replica.eval_share(1, 2) and replica.eval_share(3, 4)
    with pytest.raises(DataError, match="ask replica 0"):
        replica.eval_share(0, 2)
    plain = Engine([d], load_config(None, overrides(tmp_path, "data.eval_fraction=0", "run.eval_interval=0")).data)
    with pytest.raises(DataError, match="has no evaluation set"):
        plain.eval_share(0, 1)


def test_a_validation_corpus_of_ones_own_is_the_evaluation_set_and_training_keeps_every_document(tmp_path):
    """`data.eval_corpus`: tokenized beside the dataset (<dataset_dir>/eval, same tokenizer), every one of its
    documents eligible for the set; the training stream is the one without any split."""
    validation = tmp_path / "validation.jsonl"
    validation.write_text("".join(json.dumps({"text": f"validation document {i}: " + "words " * (40 + i)}) + "\n"
                                  for i in range(30)))
    cfg = load_config(None, overrides(tmp_path, "data.eval_fraction=0", f"data.eval_corpus=[{validation}]"))
    ensure_dataset(cfg)
    held = IndexedDataset(eval_dataset_path(cfg))
    assert len(held) == 30 and held.meta["tokenizer"] == IndexedDataset(dataset_paths(cfg)[0]).meta["tokenizer"]
    server = DataLoaderServer(cfg).start()
    try:
        whole = server.engine.eval_set
        assert len(whole) == 8
        want = [build_micro_batch([held], seqs, cfg.data.seq_len) for seqs in eval_sequences([held], cfg.data, True)]
        assert all(same(a.tensors, b.tensors) for a, b in zip(whole, want, strict=True))
        text = bytes(int(t) for mb in whole for t in mb.tensors["tokens"] if int(t) < 256).decode("utf-8", "replace")
        assert "validation document" in text
        client = DataClient(server.zmq_endpoint, server.grpc_endpoint, dp_rank=0, dp_size=1, grad_accum=2, timeout=20)
        got = client.eval_micro_batches()
        assert all(same({k: v for k, v in mb.items() if k != "cp_size"}, w.tensors)
                   for mb, w in zip(got, whole, strict=True))
        client.close()
    finally:
        server.stop()
    plain = StepStream([dataset(cfg)], cfg.data, dp_size=1)
    assert "eval_fraction" not in plain.state()  # the training stream has no split
    cfg.data.eval_micro_batches = 400
    with pytest.raises(DataError, match="`data.eval_corpus` packs into .*add documents to data.eval_corpus"):
        eval_sequences([held], cfg.data, whole=True)


def test_a_state_saved_with_another_split_is_refused_naming_it(tmp_path):
    cfg = config(tmp_path)
    d = dataset(cfg)
    state = StepStream([d], cfg.data, dp_size=1).state()
    other = load_config(None, overrides(tmp_path, "data.eval_fraction=0", "run.eval_interval=0"))
    with pytest.raises(DataError, match="eval_fraction=0.1 vs None"):
        StepStream([d], other.data, dp_size=1).check(state)


def test_asking_for_the_set_between_steps_leaves_the_training_stream_as_it_was(tmp_path):
    cfg = config(tmp_path)

    def run(ask: bool):
        server = DataLoaderServer(cfg).start()
        try:
            cls = [DataClient(server.zmq_endpoint, server.grpc_endpoint, dp_rank=r, dp_size=2, grad_accum=2, rank=r,
                              prefetch=3, timeout=20) for r in range(2)]
            got, sets = [], []
            for step in range(4):
                got.append([c.next_step() for c in cls])
                if ask and step in (1, 2):
                    time.sleep(0.2)  # the next steps' prefetched micro-batches are in the sockets
                    sets.append([c.eval_micro_batches() for c in cls])
            for c in cls:
                c.close()
            return got, sets, server.engine.eval_set
        finally:
            server.stop()

    plain, _, _ = run(ask=False)
    got, sets, whole = run(ask=True)
    for a, b in zip(plain, got, strict=True):
        assert all(same(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb, strict=True))
    for per_rank in sets:
        for r, share in enumerate(per_rank):
            assert len(share) == 4 and all(int(mb["cp_size"]) == 1 for mb in share)
            assert all(same({k: v for k, v in mb.items() if k != "cp_size"}, want.tensors)
                       for mb, want in zip(share, whole[r::2], strict=True))


def test_a_client_asking_for_the_set_finds_a_restarted_service(tmp_path, registry):  # noqa: F811
    cfg = config(tmp_path, f"run.name={registry.run}")
    ensure_dataset(cfg)

    def start():
        return restart.start_service(tmp_path, registry, *EVAL)

    first, second = start(), None
    try:
        client = DataClient.from_registry(registry, 0, 1, cfg, rank=0, world_size=1, timeout=20)
        client.next_step()
        before = client.eval_micro_batches()
        first.kill()
        first.wait()
        second = start()
        after = client.eval_micro_batches()
        assert client.reconnects == 1
        assert len(before) == 8 and all(same(a, b) for a, b in zip(before, after, strict=True))
        client.next_step()  # the training stream goes on from the restarted service
        client.close()
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_the_config_asks_for_a_split_that_is_read_and_a_set_that_can_be_dealt():
    base = ["data.eval_fraction=0.05", "run.eval_interval=10"]
    load_config(None, base)
    with pytest.raises(ConfigError, match="set `data.eval_fraction`"):
        load_config(None, ["run.eval_interval=10"])
    with pytest.raises(ConfigError, match="no evaluation reads"):
        load_config(None, ["data.eval_fraction=0.05"])
    with pytest.raises(ConfigError, match=r"must be in \[0, 1\)"):
        load_config(None, ["data.eval_fraction=1.0", "run.eval_interval=10"])
    with pytest.raises(ConfigError, match="set one"):
        load_config(None, [*base, "data.eval_corpus=[/tmp/x]"])
    load_config(None, ["run.eval_interval=10", "data.eval_corpus=[/tmp/x]"])
    with pytest.raises(ConfigError, match="read by the evaluation only"):
        load_config(None, ["data.eval_corpus=[/tmp/x]"])
    with pytest.raises(ConfigError, match="an RL run"):
        load_config(None, [*base, "rl.enabled=true"])
    from services.common.config import validate

    cfg = load_config(None, [*base, "data.eval_micro_batches=6"])
    validate(cfg, world_size=2)
    with pytest.raises(ConfigError, match="must be a multiple of the data-parallel size 4"):
        validate(cfg, world_size=4)


def test_a_blend_holds_out_of_each_dataset_and_its_datasets_take_turns_in_the_set(tmp_path):
    from tests.test_dataloader_stream import blend_cfg, open_all

    cfg = blend_cfg(tmp_path, "data.eval_fraction=0.1", "run.eval_interval=5", "data.eval_micro_batches=4")
    datasets = open_all(cfg)
    held = [set(split_documents(len(d), 0.1, cfg.data.seed)[1].tolist()) for d in datasets]
    chunks = eval_sequences(datasets, cfg.data)
    sources = [seq[0].source for chunk in chunks for seq in chunk]
    assert sources == [0, 1] * 4  # one sequence of each dataset in turn
    assert all(p.doc in held[p.source] for chunk in chunks for seq in chunk for p in seq)
    stream = StepStream(datasets, cfg.data, dp_size=1)
    for _ in range(50):
        for p in stream.sequences.next():
            assert p.doc not in held[p.source]
