"""Two runs' per-step losses side by side (metrics.jsonl files the trainer writes): does a variant train like the base?

    python bench/compare_loss_curves.py runs/bf16/metrics.jsonl runs/fp8/metrics.jsonl [--from-step 20]

Prints the losses at a few steps, the largest and the mean relative difference |loss_b - loss_a| / loss_a over the
steps from `--from-step` on (per step, and on a 10-step moving average, which is what a loss curve shows), and the
median tokens/s of each run (steps from `--from-step` on, save steps excluded).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def read(path: Path) -> dict[int, dict]:
    records = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            records[int(r["step"])] = r  # a resumed run rewrites steps: the last record wins
    if not records:
        raise SystemExit(f"{path}: no step records")
    return records


def moving_average(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", type=Path)
    ap.add_argument("variant", type=Path)
    ap.add_argument("--from-step", type=int, default=20, help="compare from this step on (after warm-up)")
    args = ap.parse_args()
    a, b = read(args.base), read(args.variant)
    steps = sorted(set(a) & set(b))
    if len(steps) < 2:
        raise SystemExit(f"the runs share {len(steps)} steps: nothing to compare")
    la, lb = [a[s]["loss"] for s in steps], [b[s]["loss"] for s in steps]
    ma, mb = moving_average(la, 10), moving_average(lb, 10)
    kept = [i for i, s in enumerate(steps) if s >= args.from_step]
    rel = [abs(lb[i] - la[i]) / abs(la[i]) for i in kept]
    rel_avg = [abs(mb[i] - ma[i]) / abs(ma[i]) for i in kept]
    print(f"{'step':>6}{args.base.parent.name[:14]:>16}{args.variant.parent.name[:14]:>16}{'rel diff':>10}")
    for i in sorted({0, *range(0, len(steps), max(1, len(steps) // 8)), len(steps) - 1}):
        print(f"{steps[i]:>6}{la[i]:>16.4f}{lb[i]:>16.4f}{100 * abs(lb[i] - la[i]) / abs(la[i]):>9.2f}%")
    print(f"steps {steps[kept[0]]}..{steps[-1]}: per step max {100 * max(rel):.2f}% "
          f"mean {100 * statistics.fmean(rel):.2f}%; 10-step average max {100 * max(rel_avg):.2f}% "
          f"mean {100 * statistics.fmean(rel_avg):.2f}%")
    for name, run in ((args.base, a), (args.variant, b)):
        tps = [run[s]["tokens_per_s"] for s in steps if s >= args.from_step and not run[s].get("ckpt_stall_s")]
        print(f"{name}: median tokens/s {statistics.median(tps):,.0f}" if tps else f"{name}: no timed steps")


if __name__ == "__main__":
    main()
