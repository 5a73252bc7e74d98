"""Chaos on a real local run (`foldmoe train`, tiny model, CPU): kill -9 the dataloader, then the checkpointer, while
the trainer runs. The launcher restarts each; the trainer resumes the data stream where it was and re-finds the writer;
the run finishes with exactly the per-step losses of an undisturbed run (the same tokens in the same order, the same
math), every checkpoint it was due to write is committed and verifies, and no process outlives the launcher.

The checkpointer is killed right after a commit, with the trainer frozen (SIGSTOP) until the replacement has
registered: the trainer-side Snapshotter does not yet wait for a writer to come back, so a save falling into the
restart window (about 3 s here) would fail the run. Once it waits and re-sends (see the ops report), the freeze goes and
a kill in the middle of a save belongs here too."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import launcher_harness as harness  # noqa: E402

from services.checkpointer.store import CheckpointStore  # noqa: E402
from services.common import procs  # noqa: E402
from services.common.registry import Registry  # noqa: E402

STEPS, INTERVAL = 24, 8
TINY = ["model.num_layers=2", "data.seq_len=128", "optimizer.warmup_steps=2", f"run.steps={STEPS}",
        f"checkpoint.interval={INTERVAL}", "checkpoint.keep_last=0", "run.max_restarts=2"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")  # tokenized once, by the first run; both runs pack the same stream


def command(tmp_path: Path, dataset: Path, name: str) -> list[str]:
    return harness.cli("train", "--config", "configs/tiny.yaml", *TINY, f"run.name={name}",
                       f"run.dir={tmp_path / 'run'}", f"data.dataset_dir={dataset}", f"checkpoint.dir={tmp_path / 'ckpt'}",
                       f"run.metrics_file={tmp_path / 'metrics.jsonl'}")


def losses(tmp_path: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records}


class RunWatch:
    """Reads a running launcher's state file and its (embedded) Redis."""

    def __init__(self, run_dir: Path, name: str, proc, deadline_s: float = 180):
        self.state_file, self.name, self.proc = run_dir / "launcher.json", name, proc
        self.deadline = time.monotonic() + deadline_s
        self.registry: Registry | None = None

    def wait(self, what: str, ready) -> None:
        while not ready():
            assert self.proc.poll() is None, f"the run ended while waiting for {what}"
            assert time.monotonic() < self.deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    def pid(self, child: str) -> int | None:
        try:
            return json.loads(self.state_file.read_text())["children"].get(child)
        except (OSError, ValueError, KeyError):
            return None

    def state(self, key: str):
        if self.registry is None:
            self.registry = Registry(json.loads(self.state_file.read_text())["redis_url"], self.name)
        return self.registry.get_state(key)

    def step(self) -> int:
        return int(self.state("step") or 0)

    def committed(self) -> int:
        return int((self.state("checkpoint/latest") or {}).get("step", 0))


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        children = procs.children_of(todo.pop())
        found += children
        todo += children
    return found


def signal_tree(pid: int, sig: int) -> None:
    """`sig` to a process and all its descendants (torchrun's workers live in sessions of their own)."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def test_killing_the_dataloader_and_then_the_checkpointer_changes_nothing_in_the_run(tmp_path, dataset):
    calm_dir, chaos_dir = tmp_path / "calm", tmp_path / "chaos"
    calm = harness.run(command(calm_dir, dataset, f"calm-{os.getpid()}"), tmp_path, env={"REDIS_URL": ""}, timeout=240)
    assert calm.rc == 0, calm.stderr[-3000:]

    name = f"chaos-{os.getpid()}"
    proc, strays_file = harness.start(command(chaos_dir, dataset, name), tmp_path, env={"REDIS_URL": ""})
    try:
        run = RunWatch(chaos_dir / "run", name, proc)
        run.wait("the trainer to start", lambda: run.pid("trainer"))
        run.wait("step 3", lambda: run.step() >= 3)
        dataloader = run.pid("dataloader")
        os.kill(dataloader, signal.SIGKILL)
        killed_at = run.step()
        run.wait("the dataloader's replacement", lambda: run.pid("dataloader") not in (None, dataloader))
        run.wait("the trainer to take steps from the new dataloader", lambda: run.step() >= killed_at + 2)

        # Right after a commit: the checkpointer dies between saves, and the next save must find its replacement.
        run.wait("a committed checkpoint", lambda: run.committed() >= INTERVAL)
        checkpointer, trainer = run.pid("checkpointer"), run.pid("trainer")
        signal_tree(trainer, signal.SIGSTOP)
        try:
            os.kill(checkpointer, signal.SIGKILL)
            run.wait("the checkpointer's replacement to register",
                     lambda: [r for r in run.registry.lookup("checkpointer") if r["pid"] != checkpointer])
        finally:
            signal_tree(trainer, signal.SIGCONT)
    finally:
        chaos = harness.finish(proc, strays_file, timeout=240)
    assert chaos.rc == 0, chaos.stderr[-3000:]
    assert "dataloader was killed by SIGKILL; restarting it (1 of 2" in chaos.stderr
    assert "checkpointer was killed by SIGKILL; restarting it (1 of 2" in chaos.stderr
    assert chaos.strays == []

    assert list(losses(chaos_dir)) == list(range(1, STEPS + 1))
    assert losses(chaos_dir) == losses(calm_dir)  # bit for bit: the same tokens, in the same order
    saved = CheckpointStore(chaos_dir / "ckpt", keep_last=0).list(checksums=True)
    assert [s.step for s in saved] == list(range(INTERVAL, STEPS + 1, INTERVAL))
    assert all(s.valid for s in saved), [s.problem for s in saved if not s.valid]
