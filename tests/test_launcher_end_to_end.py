"""The whole local topology for real: `foldmoe train` on the tiny config starts Redis, dataloader, checkpointer and a
trainer rank, trains a few steps, lands checkpoints, evaluates the held-out loss every 4 steps and after the last, and a
second run resumes exactly after the last one, on the same evaluation set; every process is gone after each run; and
`foldmoe evaluate` of the last checkpoint with the run's config reports the trainer's last held-out loss."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import launcher_harness as harness  # noqa: E402

from services.checkpointer.store import CheckpointStore  # noqa: E402


def overrides(tmp_path: Path, steps: int, metrics: str) -> list[str]:
    return [f"run.steps={steps}", "checkpoint.interval=3", "optimizer.warmup_steps=2", "run.eval_interval=4",
            f"run.dir={tmp_path / 'run'}", f"data.dataset_dir={tmp_path / 'data'}",
            f"checkpoint.dir={tmp_path / 'ckpt'}", f"run.metrics_file={tmp_path / metrics}", "run.name=e2e"]


def train(tmp_path: Path, steps: int, metrics: str) -> harness.Result:
    return harness.run(harness.cli("train", "--config", "configs/tiny.yaml", *overrides(tmp_path, steps, metrics)),
                       tmp_path, timeout=240)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def logged_steps(path: Path) -> list[int]:
    return [r["step"] for r in records(path)]


def evaluations(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in records(path) if "eval_loss" in r}


def test_train_checkpoints_and_a_second_run_resumes_at_the_right_step(tmp_path):
    first = train(tmp_path, steps=6, metrics="first.jsonl")
    assert first.rc == 0, first.stderr[-3000:]
    assert first.strays == []
    assert logged_steps(tmp_path / "first.jsonl") == [1, 2, 3, 4, 5, 6]
    assert CheckpointStore(tmp_path / "ckpt", keep_last=0).steps() == [3, 6]
    assert "trainer finished; every service stopped cleanly" in first.stderr

    second = train(tmp_path, steps=9, metrics="second.jsonl")
    assert second.rc == 0, second.stderr[-3000:]
    assert second.strays == []
    assert logged_steps(tmp_path / "second.jsonl") == [7, 8, 9]
    assert CheckpointStore(tmp_path / "ckpt", keep_last=0).latest_step() == 9

    first_evals, second_evals = evaluations(tmp_path / "first.jsonl"), evaluations(tmp_path / "second.jsonl")
    assert sorted(first_evals) == [4, 6] and sorted(second_evals) == [8, 9]
    assert len({r["eval_tokens"] for r in [*first_evals.values(), *second_evals.values()]}) == 1  # one set
    assert first_evals[4]["eval_loss"] > second_evals[9]["eval_loss"] > 0
    assert "held-out loss" in first.stdout

    # `foldmoe evaluate` with the run's config: the trainer's held-out figure at the last checkpoint's step
    evaluated = harness.run(harness.cli("evaluate", "--config", "configs/tiny.yaml", "--json",
                                        *overrides(tmp_path, 9, "second.jsonl")), tmp_path, timeout=120)
    assert evaluated.rc == 0, evaluated.stderr[-3000:]
    result = json.loads(evaluated.stdout)
    assert result["tokens"] == second_evals[9]["eval_tokens"] and "step_00000009" in result["model"]
    assert abs(result["loss"] - second_evals[9]["eval_loss"]) <= 1e-5 * second_evals[9]["eval_loss"]
