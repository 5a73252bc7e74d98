"""Per-step losses of runs side by side (metrics.jsonl files the trainer writes): does a variant train like the base?

    python bench/compare_loss_curves.py runs/bf16/metrics.jsonl runs/fp8/metrics.jsonl [--from-step 20]
    python bench/compare_loss_curves.py runs/bf16*/metrics.jsonl --vs runs/fp8*/metrics.jsonl

Prints the losses at a few steps and the largest and the mean relative difference |loss_b - loss_a| / loss_a over the
steps from `--from-step` on, per step and on a 10-step moving average (which is what a loss curve shows), and the
median tokens/s of each run (steps from `--from-step` on, save steps excluded).

With several runs on a side (`--vs`), each side's curve is the per-step mean of its runs. The same differences are then
also given between runs of one side: that is the noise floor. Runs of the same code differ where the step has
non-deterministic reductions (atomics in the backward pass) and a loss spike amplifies the difference. A variant-to-base
difference below the base's own run-to-run difference says nothing about the variant.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

WINDOW = 10


def read(path: Path) -> dict[int, dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise SystemExit(f"{path}: cannot read it ({e.strerror})") from None
    records = {}
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                r = json.loads(line)
                records[int(r["step"])] = r  # a resumed run rewrites steps: the last record wins
                float(r["loss"])
            except (ValueError, KeyError, TypeError) as e:
                raise SystemExit(f"{path}:{n}: not a trainer metrics record with a step and a loss ({e!r})") from None
    if not records:
        raise SystemExit(f"{path}: no step records")
    return records


def moving_average(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


@dataclass
class Difference:
    per_step_max: float  # relative, over the compared steps
    per_step_mean: float
    averaged_max: float  # of the 10-step moving averages
    averaged_mean: float

    def __str__(self) -> str:
        return (f"per step max {100 * self.per_step_max:.2f}% mean {100 * self.per_step_mean:.2f}%; "
                f"{WINDOW}-step average max {100 * self.averaged_max:.2f}% mean {100 * self.averaged_mean:.2f}%")


def difference(base: list[float], variant: list[float], kept: list[int]) -> Difference:
    """Relative differences of `variant` from `base` (losses at the same steps), at the indices `kept`."""
    ma, mb = moving_average(base, WINDOW), moving_average(variant, WINDOW)
    rel = [abs(variant[i] - base[i]) / abs(base[i]) for i in kept]
    rel_avg = [abs(mb[i] - ma[i]) / abs(ma[i]) for i in kept]
    return Difference(max(rel), statistics.fmean(rel), max(rel_avg), statistics.fmean(rel_avg))


def mean_curve(runs: list[dict[int, dict]], steps: list[int]) -> list[float]:
    return [statistics.fmean(run[s]["loss"] for run in runs) for s in steps]


def spread(runs: list[dict[int, dict]], steps: list[int], kept: list[int]) -> Difference | None:
    """The noise floor: each figure of `difference` at its largest over the pairs of runs of one side (the figures
    may come from different pairs); None with one run."""
    curves = [mean_curve([run], steps) for run in runs]
    pairs = [difference(a, b, kept) for a, b in itertools.combinations(curves, 2)]
    if not pairs:
        return None
    return Difference(*(max(getattr(p, f) for p in pairs)
                        for f in ("per_step_max", "per_step_mean", "averaged_max", "averaged_mean")))


def shared_steps(runs: list[dict[int, dict]], from_step: int) -> tuple[list[int], list[int]]:
    """(steps every run logged, indices of those from `from_step` on)."""
    steps = sorted(set.intersection(*(set(r) for r in runs)))
    kept = [i for i, s in enumerate(steps) if s >= from_step]
    if len(steps) < 2 or not kept:
        raise SystemExit(f"the runs share {len(steps)} steps ({len(kept)} from step {from_step} on): nothing to compare")
    return steps, kept


def label(paths: list[Path]) -> str:
    names = [p.parent.name or p.stem for p in paths]
    return names[0][:14] if len(names) == 1 else f"mean of {len(names)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", type=Path, nargs="+", help="the base's runs (with no --vs: base, then variant)")
    ap.add_argument("--vs", type=Path, nargs="+", default=None, help="the variant's runs")
    ap.add_argument("--from-step", type=int, default=20, help="compare from this step on (after warm-up)")
    args = ap.parse_args()
    base_paths, variant_paths = args.base, args.vs
    if variant_paths is None:
        if len(base_paths) != 2:
            ap.error("give two runs (base, variant), or the base's runs then --vs and the variant's runs")
        base_paths, variant_paths = base_paths[:1], base_paths[1:]
    base, variant = [read(p) for p in base_paths], [read(p) for p in variant_paths]
    steps, kept = shared_steps(base + variant, args.from_step)
    la, lb = mean_curve(base, steps), mean_curve(variant, steps)
    print(f"{'step':>6}{label(base_paths):>16}{label(variant_paths):>16}{'rel diff':>10}")
    for i in sorted({0, *range(0, len(steps), max(1, len(steps) // 8)), len(steps) - 1}):
        print(f"{steps[i]:>6}{la[i]:>16.4f}{lb[i]:>16.4f}{100 * abs(lb[i] - la[i]) / abs(la[i]):>9.2f}%")
    span = f"steps {steps[kept[0]]}..{steps[-1]}"
    print(f"{span}: {difference(la, lb, kept)}")
    for side, runs in (("base", base), ("variant", variant)):
        if (floor := spread(runs, steps, kept)) is not None:
            print(f"{span}, between two {side} runs (largest of {len(runs) * (len(runs) - 1) // 2} pairs): {floor}")
    for path, run in zip(base_paths + variant_paths, base + variant):
        tps = [run[s]["tokens_per_s"] for s in steps if s >= args.from_step and not run[s].get("ckpt_stall_s")]
        print(f"{path}: median tokens/s {statistics.median(tps):,.0f}" if tps else f"{path}: no timed steps")


if __name__ == "__main__":
    main()
