"""A tiny model pre-trained by foldmoe on the RL `arithmetic` task's format: the starting point of an RL run.

configs/rl_tiny.yaml's model is pre-trained with the launcher (`foldmoe train`, a real run: dataloader, checkpointer,
trainer) on every one-digit problem of the task, written in the rollout's exact text format ("7+5=12\n"). After
`PRETRAIN_STEPS` steps it has learned the format (every sampled completion is a number and a newline) but only part of
the answers: at temperature 1 about 39% of its samples are right (greedy, 70%), which leaves GRPO reward variance within
a group to learn from. Processes run with OMP_NUM_THREADS=1: on a 2-core machine torch's default thread pools spin
against each other.
"""

from __future__ import annotations

import json
import random
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import launcher_harness as harness  # noqa: E402

PRETRAIN_STEPS = 200
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

PRETRAIN = ["rl.enabled=false", "data.seq_len=64", "data.micro_batch_size=8", "optimizer.lr=3e-3",
            "optimizer.min_lr=3e-4", "optimizer.warmup_steps=10", "checkpoint.interval=0"]

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def problems() -> list[tuple[str, int]]:
    """Every one-digit problem of the arithmetic task as (prompt, answer), in the task's own prompt format."""
    return [(f"{a}{op}{b}=", fn(a, b)) for a in range(10) for b in range(10) for op, fn in OPS.items()]


def write_corpus(path: Path) -> None:
    """Every one-digit problem of the arithmetic task, one document each, in the rollout's exact text format."""
    from services.rl_rollout.rewards import arithmetic_prompt, arithmetic_reward

    lines = []
    for prompt, answer in problems():
        assert arithmetic_reward(prompt, f"{answer}\n", {"answer": answer}) == 1.0
        lines.append(json.dumps({"text": f"{prompt}{answer}\n"}))
    # the task's own prompt generator produces exactly these prompts
    prompt, _ = arithmetic_prompt(random.Random(0), 1)
    assert any(json.loads(line)["text"].startswith(prompt) for line in lines)
    path.write_text("\n".join(lines) + "\n")


def launch(tmp: Path, name: str, *overrides: str, timeout: float) -> list[dict]:
    """`foldmoe train --config configs/rl_tiny.yaml` with the overrides; returns the run's per-step metrics."""
    cmd = harness.cli("train", "--config", "configs/rl_tiny.yaml", f"run.name={name}-{uuid.uuid4().hex[:8]}",
                      f"run.dir={tmp / name / 'run'}", f"checkpoint.dir={tmp / name / 'ckpt'}",
                      f"run.metrics_file={tmp / name / 'metrics.jsonl'}", f"data.dataset_dir={tmp / name / 'data'}",
                      *overrides)
    result = harness.run(cmd, tmp, env=ENV, timeout=timeout)
    assert result.rc == 0, result.stderr[-3000:]
    assert result.strays == []
    return [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines() if line.strip()]


def pretrain(tmp: Path) -> Path:
    """Pre-trains configs/rl_tiny.yaml's model on the task format under `tmp`; returns its checkpoint.dir."""
    corpus = tmp / "arithmetic.jsonl"
    write_corpus(corpus)
    pre = launch(tmp, "pretrain", *PRETRAIN, f"run.steps={PRETRAIN_STEPS}", f"data.corpus=[{corpus}]", timeout=240)
    assert pre[-1]["loss"] < pre[0]["loss"] - 2, (pre[0]["loss"], pre[-1]["loss"])
    return tmp / "pretrain" / "ckpt"
