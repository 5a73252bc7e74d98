"""bench/bench_peer_torchtitan.py, the torchtitan peer of our step benchmarks: on the tiny config on the CPU it builds
torchtitan's Qwen3 MoE at our shape, trains it end to end, reports a finite throughput for our batch, and the loss on
its fixed batch falls. Needs torchtitan (`bash bench/peer/stage_torchtitan.sh`, then `source .peer/activate.sh`);
skipped where it is not importable, as in CI."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

ROOT = Path(__file__).resolve().parent.parent


def test_peer_torchtitan_tiny_cpu_run_reports_finite_throughput_and_falling_loss(tmp_path):
    out = tmp_path / "peer.jsonl"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_peer_torchtitan.py"),
           "--config", str(ROOT / "configs" / "tiny.yaml"), "--warmup", "1", "--steps", "3", "--json", str(out),
           "model.num_layers=2", "data.seq_len=64", "data.micro_batch_size=2"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU case, also on a machine with a GPU
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert result["peer"] == "torchtitan" and result["device"] == "cpu" and result["world"] == 1
    assert result["tokens_per_step"] == 2 * 64
    assert math.isfinite(result["tokens_per_s"]) and result["tokens_per_s"] > 0
    losses = result["losses"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
