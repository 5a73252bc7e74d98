"""The launcher's restart policy, proved with stand-in children (tests/fake_run.py) around the real Launcher: a service
that crashes while the trainer runs is restarted (each restart logged with the crash's log tail), at most
`run.max_restarts` times; its dead registration is gone at once, so clients see only the replacement; the embedded
Redis is restarted with its data; the trainer is never restarted; nothing outlives the launcher."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import launcher_harness as harness  # noqa: E402

from services.common.registry import Registry  # noqa: E402

FAKE = str(Path(__file__).with_name("fake_run.py"))


def launch(tmp_path: Path, *children: str, max_restarts: int, name: str = "") -> list[str]:
    cmd = [sys.executable, FAKE, "launch", str(tmp_path / "run"), "--grace", "5", "--max-restarts", str(max_restarts)]
    if name:
        cmd += ["--name", name]
    for child in children:
        cmd += ["--child", child]
    return cmd


def test_a_service_that_crashes_once_is_restarted_and_the_run_finishes(tmp_path):
    once = tmp_path / "crashed-once"
    res = harness.run(launch(tmp_path, f"checkpointer:--crash-after=0.5,--crash-once={once}",
                             "trainer:--steps=60,--step-time=0.05", max_restarts=2), tmp_path)
    assert res.rc == 0, res.stderr
    assert "foldmoe: checkpointer exited with code 3; restarting it (1 of 2, run.max_restarts)" in res.stderr
    assert "disk full, giving up" in res.stderr  # the crash's log tail is shown with the restart
    assert "trainer finished; every service stopped cleanly" in res.stderr
    log = (tmp_path / "run" / "logs" / "checkpointer.log").read_text()
    # One log for both incarnations, the restart marked between them; the replacement stopped cleanly at the end.
    assert log.count("fake checkpointer: up") == 2
    assert "--- foldmoe: restart 1 after the process exited with code 3 ---" in log
    assert log.rstrip().endswith("stopped on SIGTERM")
    assert res.strays == []


def test_a_service_that_keeps_crashing_fails_the_run_once_its_restarts_are_spent(tmp_path):
    res = harness.run(launch(tmp_path, "dataloader:--crash-after=0.3", "trainer:--steps=100000", max_restarts=2),
                      tmp_path, timeout=90)
    assert res.rc == 1
    assert res.stderr.count("foldmoe: dataloader exited with code 3; restarting it") == 2
    assert "foldmoe: error: dataloader exited with code 3 after 2 restart(s) (run.max_restarts=2)" in res.stderr
    assert res.strays == []


def test_max_restarts_zero_fails_at_the_first_crash(tmp_path):
    res = harness.run(launch(tmp_path, "checkpointer:--crash-after=0.5", "trainer:--steps=100000", max_restarts=0),
                      tmp_path)
    assert res.rc == 1
    assert "restarting" not in res.stderr
    assert "foldmoe: error: checkpointer exited with code 3;" in res.stderr
    assert res.strays == []


def test_a_failed_trainer_is_not_restarted(tmp_path):
    res = harness.run(launch(tmp_path, "trainer:--fail-at=2", max_restarts=3), tmp_path)
    assert res.rc == 1
    assert "restarting" not in res.stderr
    assert "foldmoe: error: trainer exited with code 5" in res.stderr
    assert res.strays == []


def test_the_crashed_services_registration_is_replaced_at_once_not_after_its_heartbeat_expires(tmp_path):
    name = f"restart-{time.monotonic_ns()}"
    once = tmp_path / "crashed-once"
    proc, strays_file = harness.start(launch(tmp_path, f"checkpointer:--crash-after=0.5,--crash-once={once}",
                                             "trainer:--steps=100000,--step-time=0.05", max_restarts=1, name=name),
                                      tmp_path)
    try:
        state_file = tmp_path / "run" / "launcher.json"
        deadline = time.monotonic() + 30
        first = None
        while True:
            assert time.monotonic() < deadline and proc.poll() is None, "the checkpointer was never restarted"
            state = json.loads(state_file.read_text()) if state_file.is_file() else {"children": {}}
            pid = state["children"].get("checkpointer")
            first = first or pid
            if pid and first and pid != first:
                break
            time.sleep(0.05)
        registry = Registry(state["redis_url"], name)
        # The dead record would linger for the heartbeat TTL (10 s); the launcher removed it before restarting.
        while not (records := registry.lookup("checkpointer")):
            assert time.monotonic() < deadline, "the restarted checkpointer never registered"
            time.sleep(0.05)
        assert [r["pid"] for r in records] == [pid]
    finally:
        proc.terminate()
        res = harness.finish(proc, strays_file)
    assert res.strays == []


def test_the_embedded_redis_is_restarted_with_its_data_until_its_restarts_are_spent(tmp_path):
    """Killed once, Redis comes back on its port with the run's keys and the trainer steps on; killed again with
    run.max_restarts=1 spent, the run fails naming it."""
    name = f"redis-restart-{time.monotonic_ns()}"
    proc, strays = harness.start(launch(tmp_path, "trainer:--steps=100000,--step-time=0.02", max_restarts=1, name=name),
                                 tmp_path, env={"REDIS_URL": ""})
    state_file = tmp_path / "run" / "launcher.json"

    def state() -> dict:
        deadline = time.monotonic() + 60
        while True:
            try:
                found = json.loads(state_file.read_text())
                if "trainer" in found["children"]:
                    return found
            except (OSError, ValueError):
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the launcher did not start the trainer"
            time.sleep(0.05)

    try:
        first = state()
        registry = Registry(first["redis_url"], name)
        while (registry.get_state("step") or 0) < 5:
            time.sleep(0.02)
        os.kill(first["redis_pid"], signal.SIGKILL)
        before = registry.get_state("step")  # retried until the replacement answers: the key survived
        assert before >= 5
        while (registry.get_state("step") or 0) <= before:  # the trainer writes on to the new Redis
            time.sleep(0.02)
        second = state()
        assert second["redis_pid"] != first["redis_pid"] and second["redis_url"] == first["redis_url"]
        os.kill(second["redis_pid"], signal.SIGKILL)
    finally:
        res = harness.finish(proc, strays, timeout=90)
    assert res.rc == 1
    assert "foldmoe: the embedded Redis was killed by SIGKILL; restarting it on " in res.stderr
    assert "(1 of 1, run.max_restarts)" in res.stderr
    assert "foldmoe: error: the embedded Redis was killed by SIGKILL after 1 restart(s) (run.max_restarts=1)" \
        in res.stderr
    assert res.strays == []
