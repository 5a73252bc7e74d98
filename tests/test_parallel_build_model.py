"""The trainer builds each rank's slices of the model only (parameters on the meta device until the layout has cut
them, then the seeded initial weights read box by box), and they are exactly the slices of the whole model a single
process initialises.

Four gloo processes per layout: tp2 x ep2 with sequence parallelism and a shared expert; pp2 x etp2 (w13 in its
[E, h, 2, f] view); cp2 x ep2; ep2 x etp2 (each rank one quarter of every expert's f, from the second expert on for
half of them). On every rank, `train.build_model` against the reference way (the whole model initialised, then
`parallelize`): the same parameter names, values (exactly), buffers and parallel attributes; then one training step on
each: the same loss and the same parameters after it (exactly), so the materialised parameters carry everything
parallelism attached (sequence parallel's gradient hooks included). The layouts run with blocks of a few rows
(`BLOCK_ELEMS`), so that the boxes start and end inside blocks, as a large model's do: the tiny model's parameters
are each one block at the default size. `checkpoint.init_from` then reads each rank's boxes of a single-process
checkpoint: the same slices as loading the whole model and cutting it. The seeded values are drawn only when nothing
will be loaded over them (init_from, or a resume unless the RL reference needs them).
"""

from __future__ import annotations

import math
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from parallel_harness import make_batches, save_step_one, spawn_ranks, tiny_config
from services.checkpointer.shard import Shard
from services.trainer.model import initial_weights
from services.trainer.model.initial_weights import SeededInit, block_seed
from services.trainer.model.transformer import MoETransformer

LAYOUTS = {"tp2-ep2-sp": dict(tp=2, ep=2, sequence_parallel=True), "pp2-etp2": dict(pp=2, etp=2),
           "cp2-ep2": dict(cp=2, ep=2), "ep2-etp2": dict(ep=2, etp=2)}
ATTRIBUTES = ("tensor_parallel_dim", "expert_box", "sequence_parallel")
SMALL_BLOCKS = 200  # random numbers per block in the layouts: 6 rows of the [*, 32] matrices, one expert of w13/w2


def layout_config(layout: str, init_from: str = ""):
    cfg = tiny_config(**LAYOUTS[layout])
    cfg.model.first_k_dense, cfg.model.shared_expert_ffn_hidden_size = 1, 16
    cfg.run.seed = 7
    cfg.checkpoint.init_from = init_from
    cfg.checkpoint.resume = False
    return cfg


def _step(model, cfg, groups):
    from services.trainer.parallel.parallelize import build_optimizer, forward_backward_parallel

    opt = build_optimizer(model, cfg, groups)
    opt.zero_grad()
    loss, _ = forward_backward_parallel(model, make_batches(cfg.model, 1, 2, seed=3)[0], groups, cfg,
                                        torch.device("cpu"), None, opt)
    opt.finish_grad_sync()
    opt.step(cfg.optimizer.lr)
    opt.wait_params()  # the updated parameters' all-gathers
    return loss.item()


def _worker(rank: int, world: int, out_dir: str, layout: str, init_from: str) -> None:
    from services.trainer.parallel.groups import init_groups
    from services.trainer.parallel.parallelize import parallelize
    from services.trainer.train import Runtime, build_model

    torch.set_num_threads(1)
    initial_weights.BLOCK_ELEMS = SMALL_BLOCKS  # a spawned process: for the build and the reference alike
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous-{layout}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        cfg = layout_config(layout, init_from)
        groups = init_groups(cfg)
        built = build_model(cfg, Runtime(rank, world, torch.device("cpu"), None), groups)
        reference = MoETransformer(cfg.model)
        if init_from:
            from services.checkpointer.load import load_checkpoint

            with load_checkpoint(os.path.join(init_from, "step_00000001")) as ckpt:
                reference.load_state_dict({n: ckpt.read(f"model/{n}") for n in reference.state_dict()})
        else:
            reference.init_weights(cfg.run.seed)
        parallelize(reference, cfg, groups)
        mine, theirs = dict(built.named_parameters()), dict(reference.named_parameters())
        result = {"names": (sorted(mine), sorted(theirs)),
                  "values": {n: (mine[n].detach().clone(), p.detach().clone()) for n, p in theirs.items()},
                  "attributes": {n: ({a: getattr(mine[n], a, None) for a in ATTRIBUTES},
                                     {a: getattr(p, a, None) for a in ATTRIBUTES}) for n, p in theirs.items()},
                  "buffers": {n: torch.equal(b, dict(built.named_buffers())[n]) for n, b in reference.named_buffers()}}
        if not init_from:
            result["loss"] = (_step(built, cfg, groups), _step(reference, cfg, groups))
            result["after"] = {n: torch.equal(mine[n].detach(), p.detach()) for n, p in theirs.items()}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _check(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["names"][0] == r["names"][1], f"rank {rank}: other parameters"
        for name, (got, want) in r["values"].items():
            assert torch.equal(got, want), f"rank {rank}: {name} is not the reference's slice"
        for name, (got, want) in r["attributes"].items():
            assert got == want, f"rank {rank}: {name}'s parallel attributes differ"
        assert all(r["buffers"].values()), f"rank {rank}: buffers differ {r['buffers']}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_rank_builds_exactly_its_slices_of_the_seeded_model_and_trains_alike(layout, tmp_path):
    results = spawn_ranks(_worker, (4, str(tmp_path), layout, ""), 4, str(tmp_path), timeout_s=240)
    _check(results)
    for rank, r in enumerate(results):
        assert r["loss"][0] == r["loss"][1], f"rank {rank}: loss {r['loss']}"
        assert all(r["after"].values()), f"rank {rank}: parameters differ after a step: " \
                                         f"{[n for n, same in r['after'].items() if not same]}"


def test_init_from_reads_each_ranks_boxes_of_a_single_process_checkpoint(tmp_path):
    cfg = layout_config("pp2-etp2")
    whole = MoETransformer(cfg.model)
    whole.init_weights(99)  # not the run's seed: the loaded weights must be the checkpoint's
    state = {f"model/{n}": Shard(t.detach()) for n, t in whole.state_dict().items()}
    save_step_one(str(tmp_path / "init"), 0, 1, state)
    results = spawn_ranks(_worker, (4, str(tmp_path), "pp2-etp2", str(tmp_path / "init")), 4, str(tmp_path),
                          timeout_s=240)
    _check(results)


@pytest.mark.parametrize("block_elems", [initial_weights.BLOCK_ELEMS, 100], ids=["default", "small"])
def test_the_seeded_init_reads_any_box_alike_in_either_view_of_w13(block_elems, monkeypatch):
    monkeypatch.setattr(initial_weights, "BLOCK_ELEMS", block_elems)
    cfg = tiny_config()
    model = MoETransformer(cfg.model)
    model.init_weights(5)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    init = SeededInit(cfg.model, 5, shapes)
    whole = {n: p.detach() for n, p in model.named_parameters()}
    assert all(torch.equal(init.read(n), p) for n, p in whole.items())  # init_weights' values
    emb = "embed.weight"
    assert torch.equal(init.read(emb, (5, 3), (50, 7)), whole[emb][5:55, 3:10])  # starts and ends inside blocks
    w13 = "layers.0.mlp.experts.w13"
    E, h, two_f = shapes[w13]
    assert torch.equal(init.read(w13, (1, 3, 4), (2, 5, 6)), whole[w13][1:3, 3:8, 4:10])
    four = SeededInit(cfg.model, 5, {w13: (E, h, 2, two_f // 2)})
    assert torch.equal(four.read(w13).reshape(E, h, two_f), whole[w13])
    assert torch.equal(init.read("norm.weight"), torch.ones(shapes["norm.weight"]))
    assert not torch.equal(SeededInit(cfg.model, 6, shapes).read(w13), whole[w13])  # the seed matters


def test_a_box_draws_only_the_blocks_its_rows_touch(monkeypatch):
    """An expert-parallel rank draws its own experts' numbers and no others (one expert per block here)."""
    cfg = tiny_config()
    with initial_weights.parameters_on_meta():
        shapes = {n: tuple(p.shape) for n, p in MoETransformer(cfg.model).named_parameters()}
    w13 = "layers.0.mlp.experts.w13"
    monkeypatch.setattr(initial_weights, "BLOCK_ELEMS", math.prod(shapes[w13][1:]))
    drawn = []
    monkeypatch.setattr(initial_weights, "block_seed", lambda *a: drawn.append(a[1:]) or block_seed(*a))
    SeededInit(cfg.model, 5, shapes).read(w13, (2, 0, 0), (2, *shapes[w13][1:]))
    assert drawn == [(w13, 2), (w13, 3)] or drawn == [(w13, 3), (w13, 2)]  # one thread per block


@pytest.mark.parametrize("init_from, resume_from, force, drawn", [
    (False, False, False, True),  # a fresh run
    (True, False, False, False),  # init_from's weights
    (False, True, False, False),  # a resume loads over them after the optimizer exists
    (True, True, False, False),  # ... and init_from is ignored: the resume wins
    (False, True, True, True),  # the RL reference policy is the initial one: drawn, then the resume loads the policy
    (True, True, True, False),  # ... or init_from's
])
def test_the_initial_values_are_drawn_only_when_nothing_is_loaded_over_them(init_from, resume_from, force, drawn,
                                                                            tmp_path, monkeypatch, capsys):
    """And build_model asks for the newest checkpoint once (whether init_from loads and whether to draw are both
    answered by it; the RL reference policy, which loads or draws whatever a resume does later, asks none)."""
    from services.checkpointer.convert import write_checkpoint
    from services.checkpointer.load import DirectorySource
    from services.trainer import train
    from services.trainer.parallel.groups import init_groups

    cfg = tiny_config()
    cfg.checkpoint.dir = str(tmp_path / "ckpt")
    source = MoETransformer(cfg.model)
    source.init_weights(99)  # not the run's seed
    state = source.state_dict()
    shapes = {k: tuple(t.shape) for k, t in state.items()}
    if init_from:
        cfg.checkpoint.init_from = str(write_checkpoint(tmp_path / "init", state.items(), shapes, cfg.model, "init",
                                                        "test", ""))
    if resume_from:
        write_checkpoint(tmp_path / "ckpt", state.items(), shapes, cfg.model, "resume", "test", "")
    draws, scans = [], []
    monkeypatch.setattr(train, "SeededInit", lambda *a: draws.append(a) or SeededInit(*a))
    newest = DirectorySource.newest
    monkeypatch.setattr(DirectorySource, "newest", lambda self, *a, **k: scans.append(a) or newest(self, *a, **k))
    model = train.build_model(cfg, train.Runtime(0, 1, torch.device("cpu"), None), init_groups(cfg, 1, 0),
                              force_init=force)
    assert bool(draws) == drawn
    assert len(scans) == (0 if force else 1)
    ignored = f"checkpoint.init_from={cfg.checkpoint.init_from} ignored: resuming from {tmp_path / 'ckpt'}/step_"
    assert (ignored in capsys.readouterr().err) == (init_from and resume_from and not force)
    if init_from and (force or not resume_from):
        assert all(torch.equal(t, state[n]) for n, t in model.state_dict().items())
    elif drawn:
        reference = MoETransformer(cfg.model)
        reference.init_weights(cfg.run.seed)
        assert all(torch.equal(t, reference.state_dict()[n]) for n, t in model.state_dict().items())
