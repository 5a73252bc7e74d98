"""The trainer loops write honest per-step records while the host runs ahead of the device: the folded step keeps its
loss-token count on the device (and divides by it there, as the host count did), every pre-training record times its
own step (the first and the last too), and the RL loop, which reports a step after it has queued the next one, still
records each step's own values and publishes the weights each step trained.

The loops run in-process on the CPU with their services replaced (registry, dataloader client, checkpointer, weight
publisher): what is checked is the loop, not the services (tests/test_launcher_end_to_end.py, test_rl_launcher.py run
those for real)."""

from __future__ import annotations

from contextlib import contextmanager

import json
import math
import time
from types import SimpleNamespace

import pytest
import torch

from services.common.config import load_config
from services.common.tokenizer import load_tokenizer
from services.trainer import checkpointing
from services.trainer.model.transformer import MoETransformer
from services.trainer.parallel.groups import single_process
from services.trainer.parallel.parallelize import forward_backward_parallel
from services.trainer.step import count_loss_tokens, forward_backward
from tests.parallel_harness import make_batches, tiny_config
from tests.rl_helpers import micro_batches as rl_micro_batches

# ---------------------------------------------------------------- the folded step's divisor


def test_the_folded_step_keeps_its_token_count_on_the_device_and_trains_as_the_host_count_does():
    """`forward_backward_parallel` returns the all-reduced loss-token count as a tensor (not read back: reading it would
    make the host wait for the device at every step's start), divides the loss and the aux losses by device tensors,
    and computes exactly what one process dividing by host numbers computes: loss, every gradient (aux-loss term
    included)."""
    cfg = tiny_config()
    (mbs,) = make_batches(cfg.model, steps=1, micro=3, tokens=32)
    mbs[1]["labels"][:] = -100  # a micro-batch without a loss token still counts in the aux-loss scale

    def run(folded: bool):
        model = MoETransformer(cfg.model)
        model.init_weights(3)
        if folded:
            loss, tokens = forward_backward_parallel(model, mbs, single_process(), cfg, torch.device("cpu"), None)
        else:
            for m in model.moe_layers():
                m.aux_loss_scale = 1.0 / len(mbs)
            tokens = count_loss_tokens(mbs)
            loss = forward_backward(model, mbs, tokens, torch.device("cpu"), None)
        return loss, tokens, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, tokens, grads = run(folded=True)
    want_loss, want_tokens, want_grads = run(folded=False)
    assert isinstance(tokens, torch.Tensor) and tokens.dtype == torch.int64 and tokens.ndim == 0
    assert int(tokens) == want_tokens
    assert float(loss) == float(want_loss)
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=0, atol=0, msg=name)


def test_the_aux_loss_scale_may_be_a_number_or_a_device_tensor():
    cfg = tiny_config()
    (mbs,) = make_batches(cfg.model, steps=1, micro=1, tokens=32)

    def router_grads(scale):
        model = MoETransformer(cfg.model)
        model.init_weights(5)
        for m in model.moe_layers():
            m.aux_loss_scale = scale
        forward_backward(model, mbs, 100, torch.device("cpu"), None)
        return [m.router.weight.grad.clone() for m in model.moe_layers()]

    for a, b in zip(router_grads(0.25), router_grads(torch.tensor(0.25)), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------- the loops, in-process with fake services


class _Registry:
    preset: dict = {}  # the run state a test starts the loop with

    def __init__(self, *args, **kwargs):
        self.state: dict = dict(self.preset)

    def register(self, *args, **kwargs):
        return SimpleNamespace(stop=lambda: None)

    def set_state(self, key, value):
        self.state[key] = value

    def get_state(self, key, default=None):
        return self.state.get(key, default)


class _Saver:
    copying = False
    rank, session = 0, "test"

    def wait(self):
        pass

    def close(self):
        pass


class _Exporter:
    endpoint = "http://127.0.0.1:0"

    def serve(self, *args, **kwargs):
        return self

    def observe(self, record):
        pass

    def close(self):
        pass


class _Source:
    """A checkpoint.dir with nothing to resume."""

    def newest(self, checksums: bool = True):
        return None

    def close(self):
        pass


class _NoSaveAsked:
    """No `Save` over gRPC: the interval's saves only."""

    def __init__(self, *args, **kwargs):
        pass

    def decide(self, step: int) -> bool:
        return False


class _Data:
    """The dataloader client: `steps[k]` after sleeping `waits[k]` (the time the trainer waits for step k's data)."""

    def __init__(self, steps: list, waits: list[float], eval_wait: float = 0.0, held_out: int = 8):
        self.steps, self.waits, self._next = steps, waits, 0
        # the evaluation set: `held_out` micro-batches (the tiny config's data.eval_micro_batches), taking `eval_wait`
        self.held_out = [mb for step in steps for mb in step][:1] * held_out
        self.eval_wait, self.evaluations = eval_wait, []  # the steps after which the evaluation set was asked for

    def eval_micro_batches(self):
        time.sleep(self.eval_wait)
        self.evaluations.append(self._next)
        return self.held_out

    @property
    def step(self) -> int:
        return self._next

    def next_step(self):
        time.sleep(self.waits[self._next])
        self._next += 1
        return self.steps[self._next - 1]

    def state(self) -> dict:  # an RL position: the stream entry after the last step served, its drop counters
        return {"step": self._next, "stream": {"after": f"{self._next}-0", "dropped_stale": 10 * self._next}}

    def close(self):
        pass


def _services(monkeypatch, module, data: _Data, stall: float = 0.0) -> list[int]:
    """Fake services for `module`'s loop; returns the steps the checkpointer was asked to save, as they come."""
    saved: list[int] = []

    def save(saver, cfg, model, optimizer, data_client, step, groups=None, skippable=True):
        time.sleep(stall)
        saved.append(step)
        return stall

    monkeypatch.setattr(module, "Registry", _Registry)
    monkeypatch.setattr(module, "redis_url", lambda: "redis://unused")
    monkeypatch.setattr(checkpointing, "connect", lambda *a, **k: _Saver())
    monkeypatch.setattr(checkpointing, "checkpoint_source", lambda *a, **k: _Source())  # nothing to resume
    monkeypatch.setattr(checkpointing, "SaveRequests", _NoSaveAsked)
    monkeypatch.setattr(checkpointing, "restore", lambda *a, **k: 0)
    monkeypatch.setattr(checkpointing, "attach", lambda *a, **k: None)
    monkeypatch.setattr(checkpointing, "save", save)
    from services.dataloader import client

    monkeypatch.setattr(client.DataClient, "from_registry", classmethod(lambda cls, *a, **k: data))
    return saved


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


WAIT, STALL = 0.5, 0.3


def test_each_pre_training_record_times_its_own_step_the_first_and_the_last_too(tmp_path, monkeypatch):
    """Step k is reported after step k+1 is queued. On the CPU, where queuing a step computes it, the time between
    reports was the next step's (the first record held two steps' data waits, the last next to nothing): each record
    must hold its own step's data wait and checkpoint stall, and no other step's. An evaluation (after steps 2 and 4,
    `run.eval_interval=2`, its data taking WAIT) is in the record of the step it follows, and in no step's time."""
    from services.trainer import train as train_module

    cfg = load_config("configs/tiny.yaml", [
        "model.hidden_size=32", "model.num_layers=2", "model.ffn_hidden_size=64", "model.moe_ffn_hidden_size=32",
        "model.num_experts=4", "data.seq_len=32", "data.micro_batch_size=1", "run.steps=4", "checkpoint.interval=0",
        f"run.metrics_file={tmp_path / 'metrics.jsonl'}", f"checkpoint.dir={tmp_path / 'ckpt'}",
        "run.eval_interval=2"])
    waits = [0.0, 0.0, 0.0, WAIT]  # the last step also saves the final checkpoint (STALL)
    data = _Data(make_batches(cfg.model, steps=4, micro=1), waits, eval_wait=WAIT)
    saved = _services(monkeypatch, train_module, data, STALL)
    monkeypatch.setattr(train_module, "TrainerMetrics", _Exporter)
    monkeypatch.setattr(train_module, "measure_peak_tflops", lambda *a: 0.0)
    t0 = time.perf_counter()
    assert train_module.train(cfg) == 0
    wall = time.perf_counter() - t0
    logged = _records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in logged] == [1, 2, 3, 4] and saved == [4]
    for r, wait in zip(logged, waits, strict=True):
        assert r["data_wait_s"] == pytest.approx(wait, abs=0.2)
        assert r["step_time_s"] >= r["data_wait_s"] + r["ckpt_stall_s"], r  # its own wait and stall are in it
        if wait == 0.0 and r["step"] > 1:  # (the first step also pays the lazy initialisations)
            assert r["step_time_s"] < WAIT, r  # and no other step's
        assert r["tokens_per_s"] == pytest.approx(cfg.data.seq_len / r["step_time_s"])  # one 32-token micro-batch
    assert logged[-1]["ckpt_stall_s"] == STALL
    assert sum(r["step_time_s"] for r in logged) <= wall  # the steps' times tile the loop, none counted twice
    assert data.evaluations == [2, 4]
    tokens = count_loss_tokens(data.held_out)
    for r in logged:
        assert ("eval_loss" in r) == (r["step"] in (2, 4)), r
        if "eval_loss" in r:
            assert r["eval_tokens"] == tokens and 0 < r["eval_loss"] < 10 and r["eval_time_s"] > 0


def _rl_groups(cfg, steps: int) -> list[list]:
    """`rl.groups_per_step` trajectory groups per step, step k's generated by version k (as fresh as can be)."""
    from services.rl_rollout.engine import Engine, Request
    from services.rl_rollout.publish import encode_group
    from services.rl_rollout.sampling import SamplingParams

    model = MoETransformer(cfg.model)
    model.init_weights(11)
    tok = load_tokenizer("byte")
    engine = Engine(model.eval(), tok, max_batch=8, max_seq_len=32, seed=0)
    params = SamplingParams(temperature=1.0, max_tokens=5, stop_at_eos=False)
    out = []
    for version in range(steps):
        groups = []
        for g in range(cfg.rl.groups_per_step):
            prompt = f"{version}+{g}="
            cs = engine.generate([Request(tok.encode(prompt), params, tag=i) for i in range(cfg.rl.group_size)])
            rewards = [float(i % 2) for i in range(cfg.rl.group_size)]
            groups.append(encode_group(f"w:{version}:{g}", "w", version, "test", prompt, {}, 1.0, cs, rewards))
        out.append(groups)
    engine.close()
    return out


class _Publisher:
    def __init__(self):
        self.published: dict[int, dict[str, torch.Tensor]] = {}
        self.endpoint = "tcp://127.0.0.1:0"

    def start(self):
        return self

    def prepare(self, specs):
        pass

    @contextmanager
    def new_version(self, version, specs):
        host = {k: torch.empty(spec.shape, dtype=spec.dtype) for k, spec in specs.items()}
        yield host
        self.published[version] = host

    def stop(self):
        pass


def test_each_rl_record_carries_its_own_steps_values_and_each_published_version_the_weights_it_trained(
        tmp_path, monkeypatch):
    """The RL loop reads step k's device results after it has queued step k+1: each record must still hold step k's
    metrics, data position and timings (the last step's too), and version k+1 the weights after step k (router bias
    included), as one process stepping and reading at once computes them."""
    from services.trainer.optim import build_adamw, lr_at, set_lr
    from services.trainer.rl import train_rl as rl_module
    from services.trainer.rl.step import rl_step
    from services.trainer.train import advance_router_bias, seed_everything

    steps = 3
    cfg = load_config("configs/rl_tiny.yaml", [
        f"run.steps={steps}", "rl.groups_per_step=2", "rl.group_size=4", "rl.micro_batch_tokens=48",
        "model.bias_update_rate=0.01", "optimizer.warmup_steps=1", f"run.metrics_file={tmp_path / 'metrics.jsonl'}",
        f"checkpoint.dir={tmp_path / 'ckpt'}"])
    data_steps = [rl_micro_batches(g, max_tokens=cfg.rl.micro_batch_tokens)[0] for g in _rl_groups(cfg, steps)]
    waits = [0.0, 0.0, WAIT]
    _services(monkeypatch, rl_module, _Data(data_steps, waits))
    publisher = _Publisher()
    monkeypatch.setattr(rl_module, "WeightPublisher", SimpleNamespace(from_config=lambda *a, **k: publisher))
    monkeypatch.setattr(rl_module, "discard_backlog", lambda *a, **k: 0)
    assert rl_module.train_rl(cfg) == 0
    logged = _records(tmp_path / "metrics.jsonl")

    seed_everything(cfg.run.seed)  # one process stepping and reading each step at once
    model = MoETransformer(cfg.model)
    model.init_weights(cfg.run.seed)
    optimizer = build_adamw(model, cfg.optimizer)
    want, weights = [], [{k: v.clone() for k, v in model.state_dict().items()}]
    for step in range(steps):
        set_lr(optimizer, lr_at(step, cfg.optimizer, steps))
        want.append(rl_step(model, optimizer, data_steps[step], cfg.rl, torch.device("cpu"), cfg.optimizer.clip_grad,
                            version=step, lr=lr_at(step, cfg.optimizer, steps)).read())
        advance_router_bias(model, cfg)
        weights.append({k: v.clone() for k, v in model.state_dict().items()})

    assert [r["step"] for r in logged] == [1, 2, 3]
    assert len({r["loss"] for r in logged}) == steps  # the steps differ, so a record of another step would show
    for step, (r, w) in enumerate(zip(logged, want, strict=True)):
        for key in ("loss", "grad_norm", "reward", "clip_frac", "logprob_mismatch", "response_tokens", "samples"):
            assert r[key] == pytest.approx(w[key], rel=1e-6, abs=1e-9), (step, key)
        assert r["rollout_position"] == f"{step + 1}-0" and r["dropped_stale"] == 10 * (step + 1)
        assert r["micro_batches"] == len(data_steps[step])
        assert r["rollout_wait_s"] == pytest.approx(waits[step], abs=0.2)
        assert r["step_time_s"] >= r["rollout_wait_s"]  # its own wait is in it, the last step's too
    assert sorted(publisher.published) == [0, 1, 2, 3]
    for version, state in publisher.published.items():
        assert state.keys() == weights[version].keys()
        for name, t in state.items():
            torch.testing.assert_close(t, weights[version][name], msg=f"version {version}: {name}")
    bias = [n for n in weights[1] if n.endswith("router.expert_bias")]
    assert bias and any(not torch.equal(weights[1][n], weights[0][n]) for n in bias)  # the update is published


def test_profile_steps_writes_a_trace_of_exactly_those_steps(tmp_path, monkeypatch):
    """`run.profile_steps=[2, 3]`: a Chrome trace in <run.dir>/profile with the two steps marked, and no other step."""
    from services.trainer import train as train_module

    cfg = load_config("configs/tiny.yaml", [
        "model.hidden_size=32", "model.num_layers=2", "model.ffn_hidden_size=64", "model.moe_ffn_hidden_size=32",
        "model.num_experts=4", "data.seq_len=32", "data.micro_batch_size=1", "run.steps=4", "checkpoint.interval=0",
        "run.profile_steps=[2,3]", f"run.dir={tmp_path}", f"run.metrics_file={tmp_path / 'metrics.jsonl'}",
        f"checkpoint.dir={tmp_path / 'ckpt'}"])
    _services(monkeypatch, train_module, _Data(make_batches(cfg.model, steps=4, micro=1), [0.0] * 4))
    monkeypatch.setattr(train_module, "TrainerMetrics", _Exporter)
    monkeypatch.setattr(train_module, "measure_peak_tflops", lambda *a: 0.0)
    assert train_module.train(cfg) == 0
    events = json.loads((tmp_path / "profile" / "trace_rank0.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"step 2", "step 3"} <= names and not {"step 1", "step 4"} & names
    assert any(str(n).startswith("aten::mm") or str(n).startswith("aten::addmm") for n in names)  # the model ran in it
    assert [r["step"] for r in _records(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


@pytest.mark.parametrize("steps", [[3, 2], [0, 1], [1, 5], [2]])
def test_profile_steps_outside_the_run_are_refused(steps):
    from services.common.config import ConfigError

    with pytest.raises(ConfigError, match="run.profile_steps"):
        load_config("configs/tiny.yaml", ["run.steps=4", f"run.profile_steps={steps}".replace(" ", "")])


def test_to_device_reads_the_longest_document_from_the_hosts_cu_seqlens():
    """The attention kernels take the longest document as a host number; the step hands it over from the host's
    `cu_seqlens`, so the device's copy is never read back (a host sync per micro-batch on a GPU)."""
    from services.trainer.step import to_device

    mb = {"tokens": torch.arange(10), "cu_seqlens": torch.tensor([0, 3, 9, 10], dtype=torch.int32)}
    out = to_device(mb, torch.device("cpu"))
    assert out["max_seqlen"] == 6 and "max_seqlen" not in mb
    assert to_device({**mb, "max_seqlen": 7}, torch.device("cpu"))["max_seqlen"] == 7  # given: kept


@pytest.mark.parametrize("copying", [False, True])
def test_the_host_does_not_wait_for_step_values_while_a_save_copies(tmp_path, monkeypatch, copying):
    """Step k is reported once step k+1 is queued; while a checkpoint's device-to-host copies run, a step's values come
    back only after them (the copy engine serves device-to-host copies in order), so the host queues further steps
    instead of waiting (up to train.MAX_UNREPORTED) and reports them, in order, as their values arrive."""
    from services.trainer import metrics, train as train_module

    cfg = load_config("configs/tiny.yaml", [
        "model.hidden_size=32", "model.num_layers=2", "model.ffn_hidden_size=64", "model.moe_ffn_hidden_size=32",
        "model.num_experts=4", "data.seq_len=32", "data.micro_batch_size=1", "run.steps=4", "checkpoint.interval=0",
        f"run.metrics_file={tmp_path / 'metrics.jsonl'}", f"checkpoint.dir={tmp_path / 'ckpt'}"])
    data = _Data(make_batches(cfg.model, steps=4, micro=1), [0.0] * 4)
    _services(monkeypatch, train_module, data)
    monkeypatch.setattr(_Saver, "copying", copying)
    served_at_read: list[int] = []

    class Values(metrics.StepValues):
        def ready(self) -> bool:
            return not copying  # held back by the copies

        def read(self):
            served_at_read.append(data.step)
            return super().read()

    monkeypatch.setattr(train_module, "StepValues", Values)
    monkeypatch.setattr(train_module, "TrainerMetrics", _Exporter)
    monkeypatch.setattr(train_module, "measure_peak_tflops", lambda *a: 0.0)
    assert train_module.train(cfg) == 0
    assert [r["step"] for r in _records(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    # (+1: the last step saves the final checkpoint, so its values are read before its save, to know it finite)
    assert served_at_read == ([4, 4, 4, 4, 4] if copying else [2, 3, 4, 4, 4])


@pytest.mark.parametrize("diverges", [3, 4], ids=["between-saves", "at-a-save"])
def test_a_diverged_step_stops_the_run_before_any_checkpoint_holds_it(tmp_path, monkeypatch, diverges):
    """A step whose loss is NaN (or gradient norm infinite) ends the run with TrainingDiverged naming it, after its
    record; a save at or after it is never made (checkpoint.interval=2: steps 2 and 4 save)."""
    from services.trainer import metrics, train as train_module

    cfg = load_config("configs/tiny.yaml", [
        "model.hidden_size=32", "model.num_layers=2", "model.ffn_hidden_size=64", "model.moe_ffn_hidden_size=32",
        "model.num_experts=4", "data.seq_len=32", "data.micro_batch_size=1", "run.steps=6", "checkpoint.interval=2",
        f"run.metrics_file={tmp_path / 'metrics.jsonl'}", f"checkpoint.dir={tmp_path / 'ckpt'}", "run.eval_interval=0",
        "data.eval_fraction=0"])
    data = _Data(make_batches(cfg.model, steps=6, micro=1), [0.0] * 6)
    saved = _services(monkeypatch, train_module, data)
    monkeypatch.setattr(train_module, "TrainerMetrics", _Exporter)
    monkeypatch.setattr(train_module, "measure_peak_tflops", lambda *a: 0.0)
    real = train_module.train_step

    def train_step(*args):
        values = real(*args)
        if data.step == diverges:
            host = values.read()
            key = "loss_sum" if diverges == 3 else "grad_norm"
            return metrics.StepValues(**{**host, key: torch.tensor(float("nan") if diverges == 3 else float("inf"))})
        return values

    monkeypatch.setattr(train_module, "train_step", train_step)
    with pytest.raises(metrics.TrainingDiverged, match=f"step {diverges}: .*resume from the newest checkpoint"):
        train_module.train(cfg)
    assert saved == [2]
    logged = _records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in logged] == list(range(1, diverges + 1))
    assert not math.isfinite(logged[-1]["loss" if diverges == 3 else "grad_norm"])


def test_a_diverged_run_exits_1_with_one_line(capsys):
    from services.trainer import metrics, train as train_module

    def diverging(cfg):
        metrics.check_finite(7, float("nan"), 1.0)

    assert train_module.run_rank(diverging, ["--config", "configs/tiny.yaml"], "trainer", "") == 1
    assert capsys.readouterr().err.startswith("trainer: error: step 7: loss nan, gradient norm 1.0: training diverged")
    metrics.check_finite(7, 1.0, 1.0)  # finite: nothing


def _rl_run(tmp_path, monkeypatch, rl_module, steps: int, *overrides):
    """A tiny RL run of `steps` steps against fake services: (config, its data, the steps saved, the publisher)."""
    cfg = load_config("configs/rl_tiny.yaml", [
        f"run.steps={steps}", "rl.groups_per_step=2", "rl.group_size=4", "rl.micro_batch_tokens=48",
        "optimizer.warmup_steps=1", f"run.metrics_file={tmp_path / 'metrics.jsonl'}",
        f"checkpoint.dir={tmp_path / 'ckpt'}", *overrides])
    data = _Data([rl_micro_batches(g, max_tokens=cfg.rl.micro_batch_tokens)[0] for g in _rl_groups(cfg, steps)],
                 [0.0] * steps)
    saved = _services(monkeypatch, rl_module, data)
    publisher = _Publisher()
    monkeypatch.setattr(rl_module, "WeightPublisher", SimpleNamespace(from_config=lambda *a, **k: publisher))
    monkeypatch.setattr(rl_module, "discard_backlog", lambda *a, **k: 0)
    return cfg, data, saved, publisher


def test_a_diverged_rl_step_is_neither_published_nor_checkpointed(tmp_path, monkeypatch):
    """RL: step 2's gradient norm NaN ends the run with TrainingDiverged before version 3 reaches the workers or a checkpoint
    (checkpoint.interval=1 would save every step)."""
    from services.trainer import metrics
    from services.trainer.rl import train_rl as rl_module

    cfg, data, saved, publisher = _rl_run(tmp_path, monkeypatch, rl_module, 3, "checkpoint.interval=1")
    real = rl_module.rl_train_step

    def rl_train_step(*args):
        step_metrics, loads = real(*args)
        if data.step == 2:
            step_metrics.values = metrics.StepValues(**{**step_metrics.values.read(), "grad_norm": torch.tensor(
                float("nan"))})
        return step_metrics, loads

    monkeypatch.setattr(rl_module, "rl_train_step", rl_train_step)
    with pytest.raises(metrics.TrainingDiverged, match="step 2: .*gradient norm nan"):
        rl_module.train_rl(cfg)
    assert sorted(publisher.published) == [0, 1] and saved == [1]


def test_an_rl_record_takes_the_newest_evaluation_of_the_policy_once(tmp_path, monkeypatch):
    """`rl.eval_interval`: a worker's evaluation in the run state (services/rl_rollout/worker.py `evaluate_due`) lands
    in the next record, once."""
    from services.trainer.rl import train_rl as rl_module

    cfg, *_ = _rl_run(tmp_path, monkeypatch, rl_module, 3, "rl.eval_interval=2")
    monkeypatch.setattr(_Registry, "preset", {"rl_eval": {"version": 0, "reward": 0.25, "prompts": 5, "seconds": 1.0}})
    assert rl_module.train_rl(cfg) == 0
    logged = _records(tmp_path / "metrics.jsonl")
    assert [(r["step"], r.get("eval_reward"), r.get("eval_version")) for r in logged] == [
        (1, 0.25, 0), (2, None, None), (3, None, None)]
    assert logged[0]["eval_prompts"] == 5
