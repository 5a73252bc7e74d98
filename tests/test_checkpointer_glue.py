"""The trainer's checkpoint glue (services/trainer/checkpointing.py): what a rank saves and how it comes back.

Specification: the host buffers can be sized before the first optimizer step and fit the state after it exactly; a
parameter sharded by the parallel code is saved as its box of the global tensor and each set of replicas is written by
one rank only; with on_busy=skip every rank skips when any rank is busy; `attach` makes the optimizer step wait for
the snapshot's copies (or the copies synchronous where it cannot hook the step); a save restores to the same model,
optimizer state and RNG, with expert weights stored in the layout-independent [E, h, 2, f] view; a folded layout
restores through the same `restore`, and a checkpoint of another model is refused naming the way out; a run never
starts over at step 0 beside earlier checkpoints (they would be deleted by retention or delete its saves), whether
asked to (`checkpoint.resume=false`) or because none of them verifies.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.checkpointer.load import load_checkpoint
from services.checkpointer.snapshot import Snapshotter, specs_of
from services.checkpointer.store import CheckpointStore
from services.checkpointer.writer import Writer
from services.common.config import Config, ModelConfig
from services.trainer import checkpointing
from services.trainer.model.transformer import MoETransformer
from services.trainer.optim import build_adamw
from services.trainer.parallel.distributed_optimizer import DistributedOptimizer
from services.trainer.parallel.groups import single_process

CFG = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, num_experts=4, top_k=2,
                  moe_ffn_hidden_size=16, ffn_hidden_size=48, vocab_size=64, first_k_dense=1)


def tiny(param_dtype: str = "fp32", moment_dtype: str = "fp32") -> tuple[MoETransformer, torch.optim.Optimizer]:
    model = MoETransformer(CFG)
    model.init_weights(seed=1)
    cfg = Config().optimizer
    cfg.param_dtype, cfg.moment_dtype = param_dtype, moment_dtype
    return model, build_adamw(model, cfg)


def backward(model: MoETransformer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (12,), generator=g)
    bf16 = model.output.weight.dtype == torch.bfloat16  # bf16 parameters compute under autocast, as in the trainer
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(tokens, torch.arange(12), torch.tensor([0, 12], dtype=torch.int32))
    torch.nn.functional.cross_entropy(logits.float().reshape(12, -1), tokens).backward()


def train_step(model: MoETransformer, opt: torch.optim.Optimizer, seed: int) -> None:
    opt.zero_grad()
    backward(model, seed)
    opt.step()


@contextmanager
def checkpoint_writer(directory):
    """A Snapshotter whose saves a Writer thread commits under `directory`."""
    writer = Writer(CheckpointStore(directory, keep_last=2), None)
    stop = threading.Event()
    thread = threading.Thread(target=writer.serve, args=(stop,), daemon=True)
    thread.start()
    saver = Snapshotter(writer.endpoint)
    try:
        yield saver
    finally:
        saver.close()
        stop.set()
        thread.join(10)


def test_buffers_sized_before_the_first_step_fit_the_state_after_it():
    model, opt = tiny()
    before = checkpointing.expected_specs(model, opt, rank=0)
    train_step(model, opt, 0)
    after = specs_of(checkpointing.state_shards(model, opt, rank=0))
    assert before == after
    assert any(n.startswith("optim/") and n.endswith("/exp_avg_sq") for n in after)


def axes(tp=(0, 1), dp_cp=(0, 1), edp=(0, 1), etp=(0, 1)) -> SimpleNamespace:
    mk = lambda rs: SimpleNamespace(rank=rs[0], size=rs[1])
    return SimpleNamespace(tp=mk(tp), dp_cp=mk(dp_cp), edp=mk(edp), etp=mk(etp))


def test_with_a_parallel_layout_each_piece_is_its_global_box_written_once_per_set_of_replicas():
    column = torch.nn.Parameter(torch.zeros(6, 4))
    column.tensor_parallel_dim = 0
    w13 = torch.nn.Parameter(torch.zeros(2, 4, 2 * 3))  # 2 of 8 experts, FFN slice 1 of 2 (f = 6)
    w13.expert_box = ((8, 4, 2, 6), (4, 0, 0, 3))
    norm = torch.nn.Parameter(torch.ones(4))
    model = torch.nn.Module()
    model.q, model.w13, model.norm = column, w13, norm
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    s = checkpointing.state_shards(model, opt, rank=3, groups=axes(tp=(1, 2), dp_cp=(0, 2), edp=(1, 2), etp=(1, 2)))
    q, e, n = s["model/q"], s["model/w13"], s["model/norm"]
    assert (q.global_shape, q.offsets, q.written) == ((12, 4), (6, 0), True)  # TP rank 1 of 2, DP replica 0
    assert (e.global_shape, e.offsets, tuple(e.tensor.shape), e.written) == ((8, 4, 2, 6), (4, 0, 0, 3), (2, 4, 2, 3),
                                                                             False)  # EDP replica 1 does not write
    assert (n.global_shape, n.written) == ((4,), False)  # TP-replicated: tp rank 0 writes it
    assert (s["optim/q/exp_avg"].global_shape, s["optim/q/exp_avg"].offsets) == ((12, 4), (6, 0))
    assert s["optim/q/step"].global_shape == (1,) and not s["optim/q/step"].written  # only the first box's owner
    s0 = checkpointing.state_shards(model, opt, rank=0, groups=axes(tp=(0, 2), dp_cp=(0, 2), edp=(0, 2), etp=(0, 2)))
    assert s0["model/norm"].written and s0["optim/q/step"].written and s0["model/w13"].written


class FakeSaver:
    def __init__(self, busy: bool):
        self.busy, self.on_busy = busy, "skip"


CASES = [([1], True), ([], False), ([0, 1], True)]  # (busy ranks, every rank must skip)


def _skip_worker(rank: int, init_file: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        out[rank] = [checkpointing.should_skip(FakeSaver(rank in busy)) for busy, _ in CASES]
    finally:
        dist.destroy_process_group()


def test_with_on_busy_skip_every_rank_skips_when_any_rank_is_busy(tmp_path):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_skip_worker, args=(str(tmp_path / "init"), out), nprocs=2, join=True)
        expected = [skip for _, skip in CASES]
        assert dict(out) == {0: expected, 1: expected}


def test_on_busy_wait_never_skips():
    saver = FakeSaver(True)
    saver.on_busy = "wait"
    assert checkpointing.should_skip(saver) is False


def test_attach_fences_the_optimizer_step_or_makes_copies_synchronous():
    model, opt = tiny()
    saver = Snapshotter("tcp://127.0.0.1:1")
    fences = []
    saver.fence = lambda: fences.append(1)
    checkpointing.attach(saver, model, opt, rank=0)
    checkpointing.attach(saver, model, opt, rank=0)  # idempotent: one hook
    train_step(model, opt, 0)
    assert fences == [1] and saver.sync_copy is False

    class NoHooks(torch.optim.SGD):  # like the ZeRO-1 DistributedOptimizer: no step hooks to install the fence in
        register_step_pre_hook = None

    other = Snapshotter("tcp://127.0.0.1:1")
    checkpointing.attach(other, model, NoHooks(model.parameters(), lr=0.1), rank=0)
    assert other.sync_copy is True
    saver.close(), other.close()


class FakeData:
    def __init__(self, position: int):
        self.position = position

    def state(self) -> dict:
        return {"position": self.position}

    def resume(self, state: dict) -> None:
        self.position = state["position"]


@pytest.mark.parametrize("param_dtype, moment_dtype", [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")])
def test_a_save_restores_model_optimizer_and_rng(tmp_path, param_dtype, moment_dtype):
    """With bf16 parameters the checkpoint holds each bf16 parameter and the remainder of its fp32 master weight, and a
    restore brings the master weights back exactly (not the bf16 copy rounded again)."""
    cfg = Config()
    cfg.checkpoint.dir = str(tmp_path)
    model, opt = tiny(param_dtype, moment_dtype)
    with checkpoint_writer(tmp_path) as saver:
        checkpointing.attach(saver, model, opt, rank=0)
        train_step(model, opt, 0)
        torch.manual_seed(7)
        checkpointing.save(saver, cfg, model, opt, FakeData(123), step=1)
        saver.wait(30)
        expected_rng = torch.get_rng_state()
        train_step(model, opt, 1)  # moves on after the save; the checkpoint must not see it

    with load_checkpoint(Path(tmp_path) / "step_00000001") as c:
        assert c.global_shape("model/layers.1.mlp.experts.w13") == (4, 32, 32)  # as the parallel layouts with etp=1
        bf16 = param_dtype == "bf16"
        assert c.read("model/layers.1.mlp.experts.w13").dtype == (torch.bfloat16 if bf16 else torch.float32)
        assert ("optim/layers.1.mlp.experts.w13/remainder" in c.names()) == bf16
        assert "optim/embed.weight/remainder" not in c.names()  # it stays fp32
        assert not [n for n in c.names() if n.endswith("/master")]  # fp32 masters are the model's values, not extra
        masters = {n: checkpointing.saved_value(c.read, n, set(c.names())) for n, _ in model.named_parameters()}
    fresh, fresh_opt = tiny(param_dtype, moment_dtype)
    data = FakeData(0)
    torch.manual_seed(99)
    assert checkpointing.restore(cfg, fresh, fresh_opt, data, rank=0) == 1
    assert data.position == 123 and torch.equal(torch.get_rng_state(), expected_rng)
    reference, reference_opt = tiny(param_dtype, moment_dtype)
    train_step(reference, reference_opt, 0)
    for (name, a), b in zip(reference.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    keys = ("exp_avg", "exp_avg_sq", "step") + (("remainder",) if param_dtype == "bf16" else ())
    for (name, p), q in zip(reference.named_parameters(), fresh.parameters()):
        for key in keys:
            if key in reference_opt.state[p]:
                assert torch.equal(reference_opt.state[p][key], fresh_opt.state[q][key]), key
        assert torch.equal(fresh_opt.master_value(q), reference_opt.master_value(p)), name
        assert torch.equal(masters[name], reference_opt.master_value(p)), name


@pytest.mark.parametrize("saved_as, restored_as", [("bf16", "fp32"), ("fp32", "bf16")])
def test_master_weights_cross_between_fp32_and_bf16_runs_exactly(tmp_path, saved_as, restored_as):
    """A bf16 run's checkpoint (bf16 parameters + remainders) resumes an fp32 run, and its weights start another run
    (`checkpoint.init_from`), with the fp32 master values, not their bf16 rounding; an fp32 run's checkpoint resumes a
    bf16 run whose master weights are then those fp32 values exactly."""
    cfg = Config()
    cfg.checkpoint.dir = str(tmp_path)
    model, opt = tiny(saved_as)
    train_step(model, opt, 0)
    masters = {n: opt.master_value(p).clone() for n, p in model.named_parameters()}
    with checkpoint_writer(tmp_path) as saver:
        checkpointing.save(saver, cfg, model, opt, FakeData(1), step=1)
        saver.wait(30)
    fresh, fresh_opt = tiny(restored_as)
    assert checkpointing.restore(cfg, fresh, fresh_opt, FakeData(0), rank=0) == 1
    for name, q in fresh.named_parameters():
        assert torch.equal(fresh_opt.master_value(q), masters[name]), name
    if saved_as == "bf16":
        cfg.checkpoint.init_from, cfg.checkpoint.dir = str(tmp_path), str(tmp_path / "elsewhere")
        started = MoETransformer(CFG)
        assert checkpointing.init_from(cfg, started) is not None
        for name, q in started.named_parameters():
            assert torch.equal(q.detach(), masters[name]), name


def folded(cfg: Config, model_cfg: ModelConfig = CFG, seed: int = 1) -> tuple[MoETransformer, DistributedOptimizer]:
    """The model and optimizer of a folded layout (one process: every axis one rank), as several trainer ranks run."""
    model = MoETransformer(model_cfg)
    model.init_weights(seed)
    return model, DistributedOptimizer(model, single_process(cfg), cfg.optimizer, bucket_mb=0.01)


def test_a_folded_layout_restores_its_fp32_masters_exactly_and_refuses_another_model_naming_the_fix(tmp_path):
    """The path every multi-rank trainer (pre-training and RL) resumes through: `restore` with the run's groups."""
    cfg = Config()
    cfg.checkpoint.dir = str(tmp_path)
    cfg.optimizer.param_dtype = "bf16"  # the masters differ from the bf16 parameters: a restore must not round them
    groups = single_process(cfg)
    model, opt = folded(cfg)
    opt.zero_grad()
    opt.begin_step(1)
    backward(model, 0)
    opt.step(cfg.optimizer.lr)
    with checkpoint_writer(tmp_path) as saver:
        torch.manual_seed(7)
        checkpointing.save(saver, cfg, model, opt, FakeData(123), step=1, groups=groups)
        saver.wait(30)
        expected_rng = torch.get_rng_state()

    fresh, fresh_opt = folded(cfg, seed=2)
    data = FakeData(0)
    torch.manual_seed(99)
    assert checkpointing.restore(cfg, fresh, fresh_opt, data, rank=0, groups=groups) == 1
    assert data.position == 123 and torch.equal(torch.get_rng_state(), expected_rng)
    assert fresh_opt.step_count == 1
    for b, c in zip(opt.buckets, fresh_opt.buckets, strict=True):
        assert (b.remainder is not None) == (b.params.dtype == torch.bfloat16)
        for key in ("master", "remainder", "exp_avg", "exp_avg_sq", "params"):
            if getattr(b, key) is not None:
                assert torch.equal(getattr(b, key), getattr(c, key)), key

    other, other_opt = folded(cfg, dataclasses.replace(CFG, num_experts=8))
    with pytest.raises(checkpointing.CheckpointLoadError,
                       match=r"does not match this model .*checkpoint.dir elsewhere"):
        checkpointing.restore(cfg, other, other_opt, FakeData(0), rank=0, groups=groups)


def saved_once(tmp_path: Path) -> tuple[Config, dict[str, bytes]]:
    """A config resuming from `tmp_path`, which holds one committed step, and that step's files' bytes."""
    cfg = Config()
    cfg.checkpoint.dir = str(tmp_path)
    model, opt = tiny()
    train_step(model, opt, 0)
    with checkpoint_writer(tmp_path) as saver:
        checkpointing.save(saver, cfg, model, opt, FakeData(1), step=1)
        saver.wait(30)
    return cfg, {str(p): p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}


def test_resume_false_beside_earlier_checkpoints_is_refused_naming_the_ways_out(tmp_path):
    cfg, files = saved_once(tmp_path)
    cfg.checkpoint.resume = False
    model, opt = tiny()
    with pytest.raises(checkpointing.CheckpointLoadError,
                       match=r"holds checkpoints up to step_00000001 and checkpoint.resume=false .*new directory"):
        checkpointing.restore(cfg, model, opt, FakeData(0), rank=0)
    assert {str(p): p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == files
    cfg.checkpoint.dir = str(tmp_path / "fresh")
    assert checkpointing.restore(cfg, model, opt, FakeData(0), rank=0) == 0  # an empty directory starts at step 0


def test_when_no_checkpoint_verifies_the_run_stops_naming_each_problem_instead_of_starting_over(tmp_path):
    cfg, files = saved_once(tmp_path)
    victim = sorted((tmp_path / "step_00000001").glob("*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    model, opt = tiny()
    with pytest.raises(checkpointing.CheckpointLoadError,
                       match=rf"nothing to resume from, and nothing was loaded or deleted: .*step_00000001: .*"
                             rf"{victim.name}.*sha256"):
        checkpointing.restore(cfg, model, opt, FakeData(0), rank=0)
    assert sorted(str(p) for p in tmp_path.rglob("*") if p.is_file()) == sorted(files)  # nothing deleted


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (2, 1, 3, 2)])
def test_a_flat_range_is_cut_into_at_most_2ndim_minus_1_boxes_covering_it_in_order(shape):
    """ZeRO-1 owns flat ranges of a bucket; a checkpoint stores boxes: every range of every small tensor, brute force."""
    from services.trainer.parallel.checkpoint_shards import flat_range_boxes

    numel = math.prod(shape)
    index = torch.arange(numel).reshape(shape)
    for lo in range(numel + 1):
        for hi in range(lo, numel + 1):
            boxes = flat_range_boxes(shape, lo, hi)
            assert len(boxes) <= 2 * len(shape) - 1
            got = [index[tuple(slice(o, o + n) for o, n in zip(at, size))].reshape(-1) for at, size in boxes]
            assert torch.cat(got or [torch.zeros(0, dtype=torch.long)]).tolist() == list(range(lo, hi)), (lo, hi)


def test_a_resume_under_another_learning_rate_schedule_says_which_settings_changed(tmp_path, capsys):
    """The schedule is recomputed from the step under the resuming run's settings (optim.lr_at); a change is named."""
    cfg, _ = saved_once(tmp_path)
    model, opt = tiny()
    assert checkpointing.restore(cfg, model, opt, FakeData(0), rank=0) == 1
    assert "schedule" not in capsys.readouterr().err  # the same settings: nothing to say
    cfg.optimizer.lr, cfg.run.steps = cfg.optimizer.lr / 2, cfg.run.steps + 100
    assert checkpointing.restore(cfg, model, opt, FakeData(0), rank=0) == 1
    err = capsys.readouterr().err
    assert f"optimizer.lr={cfg.optimizer.lr * 2!r} there, {cfg.optimizer.lr!r} here" in err
    assert f"run.steps={cfg.run.steps - 100} there, {cfg.run.steps} here" in err and "warmup" not in err
    assert checkpointing.schedule_changes(None, cfg) == []  # a checkpoint that recorded no config
