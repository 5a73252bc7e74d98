"""A save asked for while the run trains: the checkpointer's gRPC `Save` and `foldmoe save`.

Specification:
- an asked-for save lands on one step that every rank saves, however far apart the ranks' hosts run: ranks that
  decide at random times, with asks at random times in between, all see exactly the steps the asks answered;
- the step is the first that no rank has decided about (or the one after the run's start, before any has);
- with no trainer registered the ask is refused naming the run; once every rank is past the run's last step the answer
  is that last step, which saves anyway; a restarted trainer (a new session) never acts on its predecessor's asks;
- over gRPC: FAILED_PRECONDITION without a trainer; with `wait`, ABORTED when the trainer stops before the step;
- end to end: `foldmoe save --wait` against a running two-rank trainer (through the launcher) with no periodic saves
  commits a checkpoint of the step it names, mid-run, written by both ranks and holding that step's state.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest

from proto import checkpointer_pb2 as pb
from proto import checkpointer_pb2_grpc as pb_grpc
from services.checkpointer.control import serve_grpc
from services.checkpointer.load import load_checkpoint
from services.checkpointer.save_requests import SaveRequestError, SaveRequests, ask
from services.checkpointer.store import CheckpointStore
from services.checkpointer.writer import Writer
from services.common import grpc_server
from services.common.config import load_config
from services.common.registry import Registry

ROOT = Path(__file__).resolve().parent.parent
REDIS = "redis://127.0.0.1:6379"


@pytest.fixture
def registry():
    return Registry(REDIS, f"test-save-{uuid.uuid4().hex[:8]}")


def trainer_registered(registry: Registry):
    return registry.register("trainer", {"rank": 0}, instance="rank0-test")


def test_asked_saves_land_on_the_same_steps_on_every_rank(registry):
    ranks, last = 4, 400
    beat = trainer_registered(registry)
    requests = [SaveRequests(registry, "s1", r, start_step=0, last_step=last) for r in range(ranks)]
    seen: list[set[int]] = [set() for _ in range(ranks)]
    answered: list[int] = []

    def rank(r: int) -> None:
        rng = random.Random(r)
        for step in range(1, last + 1):
            if requests[r].decide(step):
                seen[r].add(step)
            if rng.random() < 0.05:
                time.sleep(rng.random() * 0.01)  # hosts that run apart

    def asker() -> None:
        rng = random.Random(99)
        for _ in range(25):
            time.sleep(rng.random() * 0.01)
            if (asked := ask(registry)).last:
                break
            answered.append(asked.step)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)] + [threading.Thread(target=asker)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        beat.stop()
    assert len(answered) >= 5
    assert all(s == set(answered) for s in seen), (answered, seen)


def test_the_asked_step_is_the_first_no_rank_has_decided_about(registry):
    beat = trainer_registered(registry)
    try:
        fast, slow = (SaveRequests(registry, "s1", r, start_step=10, last_step=100) for r in range(2))
        assert ask(registry).step == 11  # before any rank decided: the first step after the start
        for step in range(11, 15):
            fast.decide(step)
        slow.decide(11)
        asked = ask(registry)
        assert (asked.step, asked.last) == (15, False)
        assert not slow.decide(12) and not fast.decide(16)
        assert [slow.decide(s) for s in (13, 14, 15)] == [False, False, True]
    finally:
        beat.stop()


def test_no_trainer_is_refused_naming_the_run_and_past_the_end_answers_the_last_step(registry):
    with pytest.raises(SaveRequestError, match=f"no trainer of run '{registry.run}'"):
        ask(registry)
    beat = trainer_registered(registry)
    try:
        only = SaveRequests(registry, "s1", 0, start_step=0, last_step=3)
        for step in (1, 2, 3):
            only.decide(step)
        asked = ask(registry)
        assert (asked.step, asked.last) == (3, True)
    finally:
        beat.stop()


def test_a_restarted_trainer_never_acts_on_its_predecessors_asks(registry):
    beat = trainer_registered(registry)
    try:
        old = SaveRequests(registry, "crashed", 0, start_step=0, last_step=50)
        old.decide(1)
        assert ask(registry).step == 2
        new = SaveRequests(registry, "restarted", 0, start_step=0, last_step=50)
        assert not any(new.decide(s) for s in range(1, 6))
        assert ask(registry).step == 6  # the new session's progress, not the old one's
        assert new.decide(6)
    finally:
        beat.stop()


@pytest.fixture
def service(tmp_path, registry):
    store = CheckpointStore(tmp_path / "ckpt", keep_last=0)
    writer = Writer(store, registry)
    server, address = serve_grpc(store, writer)
    channel = grpc.insecure_channel(address)
    try:
        yield pb_grpc.CheckpointerStub(channel)
    finally:
        channel.close()
        grpc_server.stop(server, grace=0.5)
        writer.sock.close(linger=0)


def test_save_over_grpc_is_refused_without_a_trainer_and_aborted_when_it_stops_first(service, registry):
    with pytest.raises(grpc.RpcError) as refused:
        service.Save(pb.SaveRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert registry.run in refused.value.details()

    beat = trainer_registered(registry)
    SaveRequests(registry, "s1", 0, start_step=7, last_step=100)
    assert service.Save(pb.SaveRequest(), timeout=10).step == 8
    waiting = service.Save.future(pb.SaveRequest(wait=True), timeout=30)
    time.sleep(0.5)
    assert not waiting.done()
    beat.stop()  # the trainer stops without reaching the step
    with pytest.raises(grpc.RpcError) as aborted:
        waiting.result()
    assert aborted.value.code() == grpc.StatusCode.ABORTED
    assert "stopped before saving step 8" in aborted.value.details()


# ---------------------------------------------------------------- end to end


def test_foldmoe_save_wait_commits_the_named_step_of_a_running_two_rank_trainer(tmp_path):
    """Through the launcher (its embedded Redis, found by `foldmoe save` in run.dir), two expert-parallel ranks."""
    sys.path.insert(0, str(Path(__file__).parent))
    import launcher_harness as harness

    steps = 60
    overrides = [f"run.name=save-e2e-{uuid.uuid4().hex[:8]}", f"run.dir={tmp_path / 'run'}",
                 f"data.dataset_dir={tmp_path / 'data'}", f"checkpoint.dir={tmp_path / 'ckpt'}",
                 f"run.metrics_file={tmp_path / 'metrics.jsonl'}", "checkpoint.interval=0", "run.nproc=2",
                 "parallel.ep=2", "optimizer.warmup_steps=1"]
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # the launcher's own Redis
    proc, strays = harness.start(harness.cli("train", "--config", "configs/tiny.yaml", *overrides, f"run.steps={steps}"),
                                 tmp_path, env)
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "metrics.jsonl").exists():  # the first step is recorded: both ranks train
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or never trained"
            time.sleep(0.2)
        cli = subprocess.run([sys.executable, "-m", "services.cli", "save", "--wait", "--config", "configs/tiny.yaml",
                              *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert cli.returncode == 0, cli.stderr
        step = int(cli.stdout.split("save of step ")[1].split()[0])
        assert 0 < step < steps
        path = Path(cli.stdout.split("committed: ")[1].strip())
        assert path == tmp_path / "ckpt" / f"step_{step:08d}"
        with load_checkpoint(path) as ckpt:
            assert ckpt.manifest.extras[0]["step"] == step and len(ckpt.manifest.extras) == 2  # both ranks saved it
    finally:
        done = harness.finish(proc, strays, timeout=300)
    assert done.rc == 0, done.stderr[-3000:]
    assert CheckpointStore(tmp_path / "ckpt", keep_last=0).steps() == [step, steps]


def test_an_asked_save_is_never_skipped_even_with_on_busy_skip(monkeypatch):
    from services.trainer import checkpointing

    class BusySaver:
        rank, on_busy, busy = 0, "skip", True

        def __init__(self):
            self.saved = []

        def save(self, step, shards, extra, skip_if_busy):
            self.saved.append(step)

    class Data:
        def state(self):
            return {}

    monkeypatch.setattr(checkpointing, "attach", lambda *a, **k: None)
    monkeypatch.setattr(checkpointing, "state_shards", lambda *a, **k: [])
    cfg = load_config(str(ROOT / "configs/tiny.yaml"), [])
    saver = BusySaver()
    checkpointing.save(saver, cfg, None, None, Data(), 5)  # a scheduled one: skipped, the buffers are busy
    checkpointing.save(saver, cfg, None, None, Data(), 6, skippable=False)
    assert saver.saved == [6]


def test_foldmoe_save_without_a_checkpointer_names_the_run(registry, capsys, monkeypatch):
    from services import cli

    monkeypatch.setenv("REDIS_URL", REDIS)
    assert cli.main(["save", f"run.name={registry.run}"]) != 0
    assert f"no checkpointer of run '{registry.run}' is registered" in capsys.readouterr().err
