"""Checkpoints of a ZeRO-1 layout: each rank of a data-parallel group hands the checkpointer only the flat range of every
bucket it owns (parameters, Adam moments), cut into boxes of the global tensors; nothing is gathered for a save.

tp2 x dp2 with ep2 over four gloo processes (dense buckets reduced over dp = 2, expert buckets over edp = 2; the norms
are copies on both TP ranks, of which one writes): one AdamW step, a save through the checkpoint store, then
- the same layout, freshly built, restores every bucket (parameters, both moments) exactly;
- one process reads the parameters back equal to the layout's gathered ones, and what it saves in turn restores the
  four-rank layout's buckets exactly (moments through two layout changes);
- each data-parallel rank wrote about half of the optimizer state;
- a restore reads of the moments exactly the range each rank owns (a parameter partly in it reads its part only),
  and `owned_boxes` gives the elements of any range of a piece, w13 saved with or without its FFN split.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from parallel_harness import _gather_full, save_step_one, spawn_ranks, tiny_config, trained_one_step
from services.checkpointer.load import load_checkpoint
from services.checkpointer.shard import tensor_name
from services.trainer.model.transformer import MoETransformer
from services.trainer.parallel.checkpoint_shards import load_shards, owned_boxes, read_local, training_shards
from services.trainer.parallel.distributed_optimizer import DistributedOptimizer
from services.trainer.parallel.groups import single_process

BUCKET_STATE = ("params", "exp_avg", "exp_avg_sq")


def zero_config():
    cfg = tiny_config(tp=2, ep=2)
    cfg.model.first_k_dense, cfg.model.shared_expert_ffn_hidden_size = 1, 16
    return cfg


def _buckets(opt) -> list[dict[str, torch.Tensor]]:
    return [{k: getattr(b, k).clone() for k in BUCKET_STATE} for b in opt.buckets]


class CountingReads:
    """A checkpoint that counts the elements of the moments' boxes asked of it."""

    def __init__(self, ckpt):
        self.ckpt, self.moment_elements = ckpt, 0

    def __getattr__(self, name):
        return getattr(self.ckpt, name)

    def read_boxes(self, boxes):
        boxes = list(boxes)
        self.moment_elements += sum(math.prod(shape) for name, _, shape in boxes
                                    if name.endswith(("/exp_avg", "/exp_avg_sq")))
        return self.ckpt.read_boxes(boxes)


def _owned_moment_elements(opt) -> int:
    return 2 * sum(max(0, min(s.start + s.numel, b.hi) - max(s.start, b.lo)) for b in opt.buckets for s in b.slots)


def _restore_counting(path: str, model, opt, groups) -> int:
    with load_checkpoint(path) as ckpt:
        counting = CountingReads(ckpt)
        load_shards(counting, model, opt, groups)
    return counting.moment_elements


def _worker(rank: int, world: int, out_dir: str, phase: str) -> None:
    from services.trainer.parallel.groups import init_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous-{phase}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        cfg = zero_config()
        groups = init_groups(cfg)
        fresh, fresh_opt = trained_one_step(cfg, groups, seed=11)
        if phase == "save":
            model, opt = trained_one_step(cfg, groups, seed=5)
            assert opt.shard and all(b.axis.size == 2 for b in opt.buckets)
            shards = training_shards(model, opt, groups)
            save_step_one(os.path.join(out_dir, "zero"), rank, world, shards)
            dist.barrier()  # rank 0 has committed
            read = _restore_counting(os.path.join(out_dir, "zero", "step_00000001"), fresh, fresh_opt, groups)
            written = {n: s.tensor.numel() * s.tensor.element_size() for n, s in shards.items() if s.written}
            result = {"original": _buckets(opt), "restored": _buckets(fresh_opt), "written": written,
                      "full": {n: _gather_full(n, p.detach(), p, groups) for n, p in model.named_parameters()},
                      "dp_rank": groups.dp.rank, "read": read, "owned": _owned_moment_elements(fresh_opt),
                      "partly_owned": _partly_owned(fresh_opt)}
        else:  # read what one process saved from the four-rank checkpoint
            read = _restore_counting(os.path.join(out_dir, "one", "step_00000001"), fresh, fresh_opt, groups)
            result = {"restored": _buckets(fresh_opt), "read": read, "owned": _owned_moment_elements(fresh_opt)}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _partly_owned(opt) -> int:
    """Slots of which this rank owns some elements but not all."""
    return sum(0 < min(s.start + s.numel, b.hi) - max(s.start, b.lo) < s.numel for b in opt.buckets for s in b.slots)


def test_a_zero1_layout_saves_only_owned_ranges_and_restores_exactly_in_any_layout(tmp_path):
    saved = spawn_ranks(_worker, (4, str(tmp_path), "save"), 4, str(tmp_path), timeout_s=240)
    for r in saved:
        for b, (orig, back) in enumerate(zip(r["original"], r["restored"], strict=True)):
            for k in BUCKET_STATE:
                assert torch.equal(orig[k], back[k]), f"bucket {b} {k} not restored in the same layout"
    for r in saved:  # each rank reads its own range of the moments and no more
        assert r["read"] == r["owned"], (r["read"], r["owned"])
    assert sum(r["partly_owned"] for r in saved) > 0  # so a rank that read whole slots would have read more
    # the pieces are boxes of global tensors, some cut by ZeRO ranges into several (piece keys)
    assert any(tensor_name(n) != n for r in saved for n in r["written"])
    for dp_rank in (0, 1):  # half the optimizer state each (TP ranks split the TP-sharded tensors too)
        state = [sum(v for n, v in r["written"].items() if n.startswith("optim/") and not n.endswith("/step"))
                 for r in saved if r["dp_rank"] == dp_rank]
        assert sum(state) > 0
    halves = [sum(v for r in saved if r["dp_rank"] == d for n, v in r["written"].items()
                  if n.startswith("optim/") and not n.endswith("/step")) for d in (0, 1)]
    assert abs(halves[0] - halves[1]) <= 0.05 * halves[0], halves

    cfg = zero_config()
    cfg.parallel.tp = cfg.parallel.ep = 1
    one = single_process(cfg)
    model = MoETransformer(cfg.model)
    model.init_weights(3)
    opt = DistributedOptimizer(model, one, cfg.optimizer, bucket_mb=cfg.parallel.grad_bucket_mb)
    with load_checkpoint(tmp_path / "zero" / "step_00000001") as ckpt:
        load_shards(ckpt, model, opt, one)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), saved[0]["full"][name]), f"one process read {name} wrongly"
    save_step_one(str(tmp_path / "one"), 0, 1, training_shards(model, opt, one))

    again = spawn_ranks(_worker, (4, str(tmp_path), "load"), 4, str(tmp_path), timeout_s=240)
    for r, s in zip(again, saved, strict=True):
        for b, (orig, back) in enumerate(zip(s["original"], r["restored"], strict=True)):
            for k in BUCKET_STATE:
                assert torch.equal(orig[k], back[k]), f"bucket {b} {k} not restored through one process"
        assert r["read"] == r["owned"], (r["read"], r["owned"])


class SavedTensors:
    """Whole saved tensors, read by box as a checkpoint reads them."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def global_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name, offsets, shape):
        return self.tensors[name][tuple(slice(o, o + n) for o, n in zip(offsets, shape))].clone()


def test_owned_boxes_give_any_range_of_a_piece_in_either_w13_layout_and_for_plain_boxes():
    g = torch.Generator().manual_seed(0)
    E, h, f = 4, 3, 6  # the global w13 is [E, h, 2f]; this rank holds experts 1..2 and FFN columns 2..4 of each half
    full = torch.randn(E, h, 2 * f, generator=g)
    w13 = torch.nn.Parameter(torch.empty(2, h, 2 * 3))
    w13.expert_box = ((E, h, 2, f), (1, 0, 0, 2))
    w2 = torch.nn.Parameter(torch.empty(2, 3, h))
    w2.expert_box = ((E, f, h), (1, 2, 0))
    saved = {"split": full.view(E, h, 2, f).clone(), "whole": full, "w2": torch.randn(E, f, h, generator=g)}
    groups = single_process(tiny_config())
    cases = [("whole", w13), ("split", w13), ("w2", w2)]
    ckpt = SavedTensors(saved)
    for name, p in cases:
        piece = read_local(ckpt, name, p, groups).reshape(-1)
        assert piece.numel() == p.numel()
        for lo in range(p.numel()):
            for hi in range(lo + 1, p.numel() + 1):
                boxes, join = owned_boxes(ckpt, name, p, groups, lo, hi)
                assert sum(math.prod(shape) for _, _, shape in boxes) == hi - lo, (name, lo, hi)
                got = join([ckpt.read(n, o, sh) for n, o, sh in boxes])
                assert torch.equal(got, piece[lo:hi]), (name, lo, hi)
