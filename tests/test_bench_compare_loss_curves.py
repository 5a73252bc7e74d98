"""bench/compare_loss_curves.py: the relative differences of two sides' mean loss curves, and the noise floor between
runs of one side that a variant's difference must be read against."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.compare_loss_curves import difference, mean_curve, read, shared_steps, spread

ROOT = Path(__file__).resolve().parent.parent


def run(losses: dict[int, float], tokens_per_s: float = 100.0) -> dict[int, dict]:
    return {s: {"step": s, "loss": v, "tokens_per_s": tokens_per_s} for s, v in losses.items()}


def write(path: Path, losses: dict[int, float], tokens_per_s: float = 100.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in run(losses, tokens_per_s).values()))
    return path


def test_a_curve_a_fixed_fraction_off_differs_by_that_fraction_at_every_step():
    steps = list(range(1, 41))
    base = [4.0 / s ** 0.5 for s in steps]
    variant = [1.02 * v for v in base]
    d = difference(base, variant, kept=list(range(19, 40)))
    assert d.per_step_max == pytest.approx(0.02) and d.per_step_mean == pytest.approx(0.02)
    assert d.averaged_max == pytest.approx(0.02) and d.averaged_mean == pytest.approx(0.02)


def test_the_moving_average_smooths_alternating_noise_that_the_per_step_difference_sees():
    base = [2.0] * 30
    variant = [2.2 if i % 2 else 1.8 for i in range(30)]  # +-10% each step, 0 on average
    d = difference(base, variant, kept=list(range(10, 30)))
    assert d.per_step_mean == pytest.approx(0.1)
    assert d.averaged_mean == pytest.approx(0.0, abs=1e-12)


def test_a_side_is_the_mean_of_its_runs_and_its_spread_the_largest_pair():
    a, b, c = run({1: 1.0, 2: 1.0}), run({1: 3.0, 2: 3.0}), run({1: 2.0, 2: 2.0, 3: 5.0})
    steps, kept = shared_steps([a, b, c], from_step=1)
    assert steps == [1, 2] and kept == [0, 1]  # only the steps every run logged
    assert mean_curve([a, b, c], steps) == [2.0, 2.0]
    floor = spread([a, b, c], steps, kept)
    assert floor.per_step_max == pytest.approx(2.0)  # a to b: |3 - 1| / 1
    assert spread([a], steps, kept) is None  # one run has no noise floor


def test_runs_without_common_steps_past_the_warmup_are_refused():
    with pytest.raises(SystemExit, match="share 2 steps"):
        shared_steps([run({1: 1.0, 2: 1.0}), run({1: 1.0, 2: 1.0})], from_step=20)


def test_the_command_compares_two_runs_or_two_groups_with_their_noise_floor(tmp_path):
    curve = {s: 3.0 / s ** 0.5 for s in range(1, 61)}
    base = [write(tmp_path / f"bf16_{i}" / "metrics.jsonl", {s: v * (1 + 0.01 * i) for s, v in curve.items()})
            for i in range(2)]
    variant = write(tmp_path / "fp8" / "metrics.jsonl", {s: v * 1.005 for s, v in curve.items()}, tokens_per_s=130)
    script = [sys.executable, str(ROOT / "bench" / "compare_loss_curves.py")]

    pair = subprocess.run(script + [str(base[0]), str(variant)], capture_output=True, text=True, check=True).stdout
    assert "steps 20..60: per step max 0.50% mean 0.50%" in pair
    assert "between two" not in pair  # one run a side: no noise floor
    assert f"{variant}: median tokens/s 130" in pair

    groups = subprocess.run(script + [str(p) for p in base] + ["--vs", str(variant)], capture_output=True,
                            text=True, check=True).stdout
    assert "mean of 2" in groups
    assert "steps 20..60: per step max 0.00% mean 0.00%" in groups  # the base's mean is 1.005x: the variant's curve
    assert "between two base runs (largest of 1 pairs): per step max 1.00% mean 1.00%" in groups

    wrong = subprocess.run(script + [str(base[0])], capture_output=True, text=True)
    assert wrong.returncode == 2 and "give two runs" in wrong.stderr


def test_a_missing_file_or_a_line_that_is_not_a_metrics_record_is_named(tmp_path):
    with pytest.raises(SystemExit, match="nope.jsonl: cannot read it"):
        read(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "loss": 2.0}\n{"step": 2}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:2: not a trainer metrics record"):
        read(bad)
