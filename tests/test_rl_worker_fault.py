"""A rollout worker, then the dataloader, then the checkpointer, killed with SIGKILL in the middle of an RL run do not
end the run (issue #9's chaos test in RL mode; tests/test_ops_chaos.py kills the dataloader and the checkpointer of a
pre-training run): the launcher restarts each, the replacement worker pulls the trainer's current weights, the trainer's
dataloader client resumes the replacement dataloader from its last fully received step, the trainer keeps getting
groups within the staleness bound and no trajectory group twice (every step consumes the stream entries after the
previous step's last one, so the ids the steps record must only grow), and the run finishes with every step, every
checkpoint committed and verified (checksums), and no process left behind."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import launcher_harness as harness  # noqa: E402
from test_rl_launcher import forget_stream, records, rl_train  # noqa: E402

from services.checkpointer.store import CheckpointStore  # noqa: E402

STEPS = 16  # room for three kills in turn, each mid-run (at 10 the run once ended before the third)


def wait_for(what: str, cond, proc, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before {what}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_worker_the_dataloader_then_the_checkpointer_killed_mid_run_are_replaced_and_the_run_finishes(tmp_path):
    run = f"rl-fault-{uuid.uuid4().hex[:8]}"
    proc, strays_file = rl_train(tmp_path, run, STEPS, "run.max_restarts=2", "checkpoint.keep_last=0", wait=False)
    try:
        wait_for("step 2", lambda: len(records(tmp_path)) >= 2, proc, timeout=240)  # start-up on a busy 2-core box
        state = json.loads((tmp_path / "run" / "launcher.json").read_text())
        victim = state["children"]["rollout0"]
        os.kill(victim, signal.SIGKILL)
        killed_at = len(records(tmp_path))
        wait_for("a step after the worker's restart", lambda: len(records(tmp_path)) > killed_at, proc, timeout=120)
        dataloader = json.loads((tmp_path / "run" / "launcher.json").read_text())["children"]["dataloader"]
        os.kill(dataloader, signal.SIGKILL)
        dataloader_killed_at = len(records(tmp_path))
        wait_for("a step after the dataloader's restart", lambda: len(records(tmp_path)) > dataloader_killed_at + 1,
                 proc, timeout=120)
        checkpointer = json.loads((tmp_path / "run" / "launcher.json").read_text())["children"]["checkpointer"]
        os.kill(checkpointer, signal.SIGKILL)
        checkpointer_killed_at = len(records(tmp_path))
        result = harness.finish(proc, strays_file, timeout=180)
    finally:
        forget_stream(run)
    assert killed_at < STEPS, "the run finished before the worker was killed; the test proves nothing"
    assert dataloader_killed_at < STEPS - 1, "the run finished before the dataloader was killed"
    assert checkpointer_killed_at < STEPS, "the run finished before the checkpointer was killed"
    assert result.rc == 0, result.stderr[-3000:]
    assert result.strays == []
    assert "rollout0 was killed by SIGKILL; restarting it" in result.stderr
    logged = records(tmp_path)
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    assert all(r["staleness_max"] <= 1 for r in logged)
    assert "dataloader was killed by SIGKILL; restarting it" in result.stderr
    positions = [tuple(int(x) for x in r["rollout_position"].split("-")) for r in logged]
    assert positions == sorted(set(positions)), positions  # no stream entry (group) in two steps
    assert all(r["samples"] == 2 * 8 for r in logged)  # rl.groups_per_step whole groups each step
    # The replacement started from the trainer's weights of that moment, not from version 0.
    log = (tmp_path / "run" / "logs" / "rollout0.log").read_text().split("--- foldmoe: restart 1")[-1]
    assert "loaded weights version" in log and "loaded weights version 0 " not in log
    assert "checkpointer was killed by SIGKILL; restarting it" in result.stderr
    saved = CheckpointStore(tmp_path / "ckpt", keep_last=0).list(checksums=True)
    assert [s.step for s in saved] == list(range(2, STEPS + 1, 2))  # checkpoint.interval=2: none lost
    assert all(s.valid for s in saved), [s.problem for s in saved if not s.valid]
