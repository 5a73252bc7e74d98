"""The step stream: blends of datasets by weight, dynamic CP sizing per micro-batch, and exact state restore."""

from __future__ import annotations

import os

import pytest
import torch

from services.common.config import load_config
from services.dataloader.cp_sizing import allowed_cp_sizes, attention_cost, segment_lengths
from services.dataloader.dataset import IndexedDataset
from services.dataloader.errors import DataError
from services.dataloader.preprocess import dataset_paths, ensure_dataset
from services.dataloader.stream import StepStream

STDLIB = os.path.dirname(os.__file__)
JSON_PY = os.path.join(STDLIB, "json", "*.py")
EMAIL_PY = os.path.join(STDLIB, "email", "*.py")


def blend_cfg(tmp_path, *extra):
    return load_config(None, [f"data.corpus=[{JSON_PY},{EMAIL_PY}]", "data.blend_weights=[3,1]",
                              f"data.dataset_dir={tmp_path / 'ds'}", "data.seq_len=64", "data.micro_batch_size=2",
                              "data.grad_accum=2", "data.packing_window=32", *extra])


def open_all(cfg):
    ensure_dataset(cfg)
    return [IndexedDataset(p) for p in dataset_paths(cfg)]


def test_blend_builds_one_dataset_per_corpus_entry_and_samples_by_weight(tmp_path):
    cfg = blend_cfg(tmp_path)
    datasets = open_all(cfg)
    assert [p.name for p in dataset_paths(cfg)] == ["part-0", "part-1"]
    stream = StepStream(datasets, cfg.data, dp_size=1)
    picks = [stream.sequences._pick(n) for n in range(4000)]
    assert abs(picks.count(0) / 4000 - 0.75) < 0.03
    step = stream.next_step()
    assert step.per_rank[0][0].tensors["tokens"].shape == (128,)


def test_blended_stream_restores_exactly_from_a_saved_state(tmp_path):
    cfg = blend_cfg(tmp_path)
    datasets = open_all(cfg)
    ref = StepStream(datasets, cfg.data, dp_size=2)
    for _ in range(7):
        ref.next_step()
    saved = ref.state()
    tail = [ref.next_step() for _ in range(5)]
    restored = StepStream(datasets, cfg.data, dp_size=2)
    restored.reset(saved)
    for a, b in zip(tail, [restored.next_step() for _ in range(5)]):
        for ra, rb in zip(a.per_rank, b.per_rank):
            assert all(torch.equal(x.tensors["tokens"], y.tensors["tokens"]) for x, y in zip(ra, rb))
    assert saved["blend_weights"] == [3.0, 1.0] and "+" in saved["dataset"]


def test_blend_weights_must_match_the_corpus_entries(tmp_path):
    cfg = blend_cfg(tmp_path, "data.blend_weights=[1]")
    with pytest.raises(DataError, match="one positive weight per `data.corpus` entry"):
        ensure_dataset(cfg)


def test_state_of_a_different_blend_is_refused(tmp_path):
    cfg = blend_cfg(tmp_path)
    stream = StepStream(open_all(cfg), cfg.data, dp_size=1)
    with pytest.raises(DataError, match="blend_weights"):
        stream.reset({**stream.state(), "blend_weights": [1.0, 1.0]})


def dynamic_cp_cfg(tmp_path):
    # seq_len 512: packed sequences mix a few long documents with many short ones, so attention cost varies a lot.
    return load_config(None, [f"data.corpus=[{JSON_PY}]", f"data.dataset_dir={tmp_path / 'ds'}", "data.seq_len=512",
                              "data.micro_batch_size=1", "data.grad_accum=4", "data.packing_window=64",
                              f"data.cp_max_attn_per_rank={512 ** 2 / 4}", "parallel.cp_sizes=[1,2,4]"])


def rank_time(micro_batches, seq_len):
    """A dp rank's time as its CP ranks (the largest size, 4) run its micro-batches."""
    from services.dataloader.cp_sizing import dp_rank_time
    return dp_rank_time([(segment_lengths(mb.tensors["cu_seqlens"]), mb.cp_size) for mb in micro_batches], 4, seq_len)


def test_dynamic_cp_gives_each_micro_batch_the_smallest_size_under_budget(tmp_path):
    cfg = dynamic_cp_cfg(tmp_path)
    stream = StepStream(open_all(cfg), cfg.data, dp_size=2, cp_sizes=cfg.parallel.cp_sizes)
    seen = set()
    for _ in range(20):
        for rank in stream.next_step().per_rank:
            assert len(rank) == cfg.data.grad_accum
            for mb in rank:
                cu = mb.tensors["cu_seqlens"]
                cost = attention_cost((cu[1:] - cu[:-1]).tolist())
                assert cost <= cfg.data.cp_max_attn_per_rank * mb.cp_size or mb.cp_size == 4
                assert mb.cp_size == 1 or cost > cfg.data.cp_max_attn_per_rank * (mb.cp_size // 2)
                seen.add(mb.cp_size)
    assert len(seen) >= 2  # the corpus really produces micro-batches of different sizes


def test_dynamic_cp_balances_work_across_dp_ranks_better_than_dealing_in_order(tmp_path):
    cfg = dynamic_cp_cfg(tmp_path)
    balanced = StepStream(open_all(cfg), cfg.data, dp_size=2, cp_sizes=cfg.parallel.cp_sizes)
    worst_balanced = worst_in_order = 0.0
    for _ in range(20):
        step = balanced.next_step()
        worst_balanced += max(rank_time(rank, 512) for rank in step.per_rank)
    unbalanced = StepStream(open_all(cfg), cfg.data, dp_size=2, cp_sizes=cfg.parallel.cp_sizes)
    unbalanced._size_and_balance = lambda micro: _size_only(unbalanced, micro)
    for _ in range(20):
        step = unbalanced.next_step()
        worst_in_order += max(rank_time(rank, 512) for rank in step.per_rank)
    assert worst_balanced < worst_in_order


def _size_only(stream, micro):
    """What the stream would do without balancing: size each micro-batch, deal them out in order."""
    from services.dataloader.cp_sizing import choose_cp_size
    for mb in micro:
        cu = mb.tensors["cu_seqlens"]
        mb.cp_size = choose_cp_size((cu[1:] - cu[:-1]).tolist(), stream.cp_sizes, stream.budget)
    ga = stream.cfg.grad_accum
    return [micro[r * ga:(r + 1) * ga] for r in range(stream.dp_size)]


def test_static_cp_sizes_every_micro_batch_for_the_whole_cp_group(tmp_path):
    cfg = load_config(None, [f"data.corpus=[{JSON_PY}]", f"data.dataset_dir={tmp_path / 'ds'}", "data.seq_len=64",
                             "data.micro_batch_size=2", "data.grad_accum=2", "parallel.cp=4"])
    sizes = allowed_cp_sizes(cfg.parallel)
    assert sizes == [4]
    stream = StepStream(open_all(cfg), cfg.data, dp_size=2, cp_sizes=sizes)
    assert {mb.cp_size for _ in range(5) for rank in stream.next_step().per_rank for mb in rank} == {4}


def test_dynamic_cp_sizes_must_divide_the_cp_dimension():
    cfg = load_config(None, ["parallel.cp=4", "parallel.cp_sizes=[1,2,4]"])
    assert allowed_cp_sizes(cfg.parallel) == [1, 2, 4]
    with pytest.raises(DataError, match=r"sizes \[3, 8\] that do not divide `parallel.cp=4`"):
        allowed_cp_sizes(load_config(None, ["parallel.cp=4", "parallel.cp_sizes=[1,3,8]"]).parallel)


def test_a_micro_batch_that_cannot_be_cut_into_zigzag_chunks_is_refused_at_start(tmp_path):
    cfg = load_config(None, [f"data.corpus=[{JSON_PY}]", f"data.dataset_dir={tmp_path / 'ds'}", "data.seq_len=63",
                             "data.micro_batch_size=2", "parallel.cp=2"])
    with pytest.raises(DataError, match="126 tokens cannot be cut into 2\\*cp = 4 equal zigzag chunks"):
        StepStream(open_all(cfg), cfg.data, dp_size=1, cp_sizes=allowed_cp_sizes(cfg.parallel))
