"""`foldmoe status` finds a running launcher's Redis through the run dir and shows the registered services with their
gRPC health and endpoints, the step the trainer reached, the latest checkpoint and the trainer's last step record."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import launcher_harness as harness  # noqa: E402

from services.common.registry import Registry  # noqa: E402

FAKE = str(Path(__file__).with_name("fake_run.py"))


def test_status_of_a_running_run_lists_services_step_and_latest_checkpoint(tmp_path):
    run_dir, name = tmp_path / "run", f"status-{time.monotonic_ns()}"
    cmd = [sys.executable, FAKE, "launch", str(run_dir), "--name", name,
           "--child", "trainer:--steps=100000,--step-time=0.02"]
    proc, strays_file = harness.start(cmd, tmp_path)
    try:
        state_file = run_dir / "launcher.json"
        deadline = time.monotonic() + 30
        while not (state_file.is_file() and "trainer" in json.loads(state_file.read_text())["children"]):
            assert time.monotonic() < deadline and proc.poll() is None, "the fake run never started its trainer"
            time.sleep(0.1)
        registry = Registry(json.loads(state_file.read_text())["redis_url"], name)
        while not registry.get_state("step"):
            assert time.monotonic() < deadline, "the fake trainer never reported a step"
            time.sleep(0.1)
        registry.set_state("checkpoint/latest", {"step": 3, "path": "/ckpt/step-3"})

        res = harness.run(harness.cli("status", f"run.dir={run_dir}", f"run.name={name}"), tmp_path,
                          env={"REDIS_URL": ""})
        assert res.rc == 0, res.stderr
        lines = res.stdout.splitlines()
        assert lines[0] == f"run {name!r} on {registry.url}"
        services = [line.split()[0] for line in lines[1:] if line.startswith("  ")]
        assert services == ["checkpointer", "dataloader"]
        assert '"grpc": "127.0.0.1:' in res.stdout  # the fake dataloader's endpoint is shown
        health = {line.split()[0]: line.split()[4] for line in lines[1:] if line.startswith("  ")}
        assert health == {"dataloader": "SERVING", "checkpointer": "-"}  # the fake checkpointer has no gRPC
        step_line = next(line for line in lines if line.startswith("step: "))
        assert int(step_line.split()[1]) >= 1
        assert 'latest checkpoint: {"step": 3, "path": "/ckpt/step-3"}' in lines
    finally:
        proc.terminate()
        res = harness.finish(proc, strays_file)
    assert res.strays == []


def test_status_shows_the_trainers_last_step_record(tmp_path):
    name = f"status-{time.monotonic_ns()}"
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n" +
                       json.dumps({"step": 2, "loss": 4.25, "tokens_per_s": 1234.5, "mfu": None}) + "\n")
    res = harness.run(harness.cli("status", f"run.name={name}", f"run.metrics_file={metrics}"), tmp_path,
                      env={"REDIS_URL": "redis://127.0.0.1:6379"})
    assert res.rc == 0, res.stderr
    assert "  (no services registered)" in res.stdout
    assert f"last record ({metrics}) step 2: loss 4.25, tokens_per_s 1234" in res.stdout
