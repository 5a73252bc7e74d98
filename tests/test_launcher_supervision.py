"""The launcher's supervision contract, proved with stand-in children (tests/fake_run.py) around the real Launcher:
services must register (and report gRPC SERVING) before the trainer starts; the trainer's output reaches the terminal;
any child failing, or a signal to the launcher, stops every process, names the failed child with its exit code and
log tail, and exits non-zero; nothing it started outlives it (checked by a subreaper harness)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import launcher_harness as harness  # noqa: E402

FAKE = str(Path(__file__).with_name("fake_run.py"))


def launch(tmp_path: Path, *children: str, grace: float = 5.0, start_timeout: float = 30.0,
           max_restarts: int = 0) -> list[str]:
    cmd = [sys.executable, FAKE, "launch", str(tmp_path / "run"), "--grace", str(grace),
           "--start-timeout", str(start_timeout), "--max-restarts", str(max_restarts)]
    for child in children:
        cmd += ["--child", child]
    return cmd


def test_successful_run_streams_trainer_output_and_stops_services_cleanly(tmp_path):
    res = harness.run(launch(tmp_path, "trainer:--steps=4"), tmp_path)
    assert res.rc == 0, res.stderr
    assert [line for line in res.stdout.splitlines() if line.startswith("step ")] == [
        f"step {i}/4 loss 1.0" for i in range(1, 5)]
    assert res.strays == []
    assert "dataloader is ready" in res.stderr and "checkpointer is ready" in res.stderr
    assert "trainer finished; every service stopped cleanly" in res.stderr
    logs = tmp_path / "run" / "logs"
    # Each service got SIGTERM and stopped on its own; the trainer's streamed output is also in its log.
    assert "stopped on SIGTERM" in (logs / "dataloader.log").read_text()
    assert "stopped on SIGTERM" in (logs / "checkpointer.log").read_text()
    assert "step 4/4" in (logs / "trainer.log").read_text()
    assert (tmp_path / "run" / "config.yaml").is_file()
    assert not (tmp_path / "run" / "launcher.json").exists()


def test_trainer_starts_only_after_every_service_is_ready(tmp_path):
    res = harness.run(launch(tmp_path, "trainer:--steps=1"), tmp_path)
    assert res.rc == 0, res.stderr
    order = [line for line in res.stderr.splitlines() if "is ready" in line or "started trainer" in line]
    assert order[-1].startswith("foldmoe: started trainer"), order
    assert len(order) == 3


def test_crashing_service_stops_everything_and_is_named_with_its_exit_code_and_log(tmp_path):
    res = harness.run(launch(tmp_path, "checkpointer:--crash-after=1", "trainer:--steps=1000"), tmp_path)
    assert res.rc == 1
    assert "foldmoe: error: checkpointer exited with code 3" in res.stderr
    assert "disk full, giving up" in res.stderr  # the tail of its log
    assert res.strays == []
    assert "stopped on SIGTERM" in (tmp_path / "run" / "logs" / "dataloader.log").read_text()


def test_failing_trainer_is_named_with_its_exit_code(tmp_path):
    res = harness.run(launch(tmp_path, "trainer:--fail-at=2"), tmp_path)
    assert res.rc == 1
    assert "foldmoe: error: trainer exited with code 5" in res.stderr
    assert "NaN loss at step 2" in res.stderr
    assert res.strays == []


def test_service_that_never_registers_fails_the_start_naming_it(tmp_path):
    res = harness.run(launch(tmp_path, "checkpointer:--no-register", start_timeout=2), tmp_path)
    assert res.rc == 1
    assert "foldmoe: error: checkpointer did not register as 'checkpointer'" in res.stderr
    assert "started trainer" not in res.stderr
    assert res.strays == []


def test_service_ignoring_sigterm_is_killed_after_the_grace_period_and_the_run_fails(tmp_path):
    t0 = time.monotonic()
    res = harness.run(launch(tmp_path, "checkpointer:--ignore-term", "trainer:--steps=1", grace=1), tmp_path)
    assert res.rc == 1
    assert "checkpointer did not stop within 1s of SIGTERM and was killed" in res.stderr
    assert "fake checkpointer: ignoring SIGTERM" in res.stderr  # the tail of its log says what it was doing
    assert res.strays == []
    assert time.monotonic() - t0 < 30


def test_a_service_whose_stop_hangs_logs_its_stacks_at_half_the_launchers_grace(tmp_path):
    # The launcher hands its grace period to the services (FOLDMOE_STOP_GRACE); they dump every thread's stack at half
    # of it, so the dump is in the log tail the launcher prints when it kills them.
    res = harness.run(launch(tmp_path, "checkpointer:--slow-stop", "trainer:--steps=1", grace=2), tmp_path)
    assert res.rc == 1
    assert "checkpointer did not stop within 2s of SIGTERM and was killed" in res.stderr
    assert "in finishing_a_write_that_never_ends" in res.stderr
    assert res.strays == []


@pytest.mark.parametrize("grace, dumps", [("8", False), ("1", True)])
def test_the_stack_dump_waits_for_half_the_grace_period(grace, dumps):
    # A stop of 1.5 s: inside half of an 8 s grace (no dump), past half of a 1 s one (dump).
    code = ("import os, signal, threading, time\nfrom services.common import procs\n"
            "stop = threading.Event()\nprocs.stop_on_signals(stop)\nos.kill(os.getpid(), signal.SIGTERM)\n"
            "assert stop.wait(5)\ndef waiting_on_the_disk(): time.sleep(1.5)\nwaiting_on_the_disk()")
    res = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                         env={**os.environ, "FOLDMOE_STOP_GRACE": grace}, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert ("in waiting_on_the_disk" in res.stderr) == dumps, res.stderr


@pytest.mark.parametrize("value", ["soon", "0", "-3", "inf"])
def test_a_malformed_stop_grace_fails_at_start_up_naming_the_variable(monkeypatch, value):
    from services.common import procs

    monkeypatch.setenv("FOLDMOE_STOP_GRACE", value)
    with pytest.raises(ValueError, match=f"FOLDMOE_STOP_GRACE='{value}'.*positive number"):
        procs.stop_on_signals(threading.Event())


@pytest.mark.parametrize("service", ["services.dataloader.server", "services.rl_rollout.worker",
                                     "services.checkpointer.writer"])
def test_a_service_with_a_malformed_stop_grace_exits_2_before_starting_anything(monkeypatch, capsys, service):
    import importlib

    monkeypatch.setenv("FOLDMOE_STOP_GRACE", "soon")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1")  # unreachable: a start before the check would fail there
    assert importlib.import_module(service).main([]) == 2
    assert "FOLDMOE_STOP_GRACE='soon'" in capsys.readouterr().err


def test_grandchildren_orphaned_by_the_trainer_are_ended(tmp_path):
    # torchrun starts its workers in sessions of their own; a process-group stop alone would miss them.
    res = harness.run(launch(tmp_path, "trainer:--orphan"), tmp_path)
    assert res.rc == 0, res.stderr
    assert "ended 1 leftover process(es)" in res.stderr
    assert res.strays == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_the_launcher_stops_every_process(tmp_path, sig):
    proc, strays_file = harness.start(launch(tmp_path, "trainer:--steps=100000"), tmp_path)
    state = tmp_path / "run" / "launcher.json"
    deadline = time.monotonic() + 30
    while not (state.is_file() and "trainer" in json.loads(state.read_text()).get("children", {})):
        assert time.monotonic() < deadline and proc.poll() is None, "the trainer never started"
        time.sleep(0.1)
    proc.send_signal(sig)  # the harness forwards it to the launcher
    res = harness.finish(proc, strays_file)
    assert res.rc == 128 + sig
    assert f"foldmoe: {signal.Signals(sig).name}: stopped every process of run" in res.stderr
    assert res.strays == []
