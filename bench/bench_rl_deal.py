"""How evenly the RL source spreads a step's work over the dp ranks (CPU only: it plans, it builds no tensors).

    python bench/bench_rl_deal.py [--steps 200] [--groups 32] [--group-size 8] [--dp 2 4] [--cp-sizes 1 2 4]

Lengths: each group draws a prompt (64-512 tokens) and a typical response length (log-normal, median
`--median` tokens, sigma 0.8); its samples' responses scatter log-normally around it (sigma 0.6), capped at
`--max-len` tokens in all: a long-tailed mix of short answers and a few very long ones, as reasoning RL makes.
Time of a rank: as the trainer runs its micro-batches on `max(--cp-sizes)` CP ranks (`cp_sizing.dp_rank_time`: the
blocks of `cp_sizing.block_share`, each micro-batch at `cp_sizing.work` / its CP size; the slowest CP rank's sum).
Per step: the imbalance (the slowest rank's time over the mean rank's) and the slowest rank's time over the previous
plan's (what the step's time follows: the mean itself moves with the CP sizes, which depend on the packing).

"before": the previous plan (whole samples dealt by positions, longest first to the rank with the fewest; each rank's
share packed by best-fit-decreasing; then each micro-batch sized); "after": `rollout_source.plan_step` (pack the whole
step, size, deal the micro-batches by work). Prints a table and one JSON line per dp size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.dataloader.cp_sizing import CPBudget, choose_cp_size, dp_rank_time  # noqa: E402
from services.dataloader.packing import best_fit_decreasing  # noqa: E402
from services.dataloader.rollout_source import RLSample, plan_step  # noqa: E402


def sample(positions: int) -> RLSample:
    """A sample of `positions` fed tokens; only its length matters to the plan."""
    empty = np.zeros(0, dtype=np.float32)
    return RLSample(np.zeros(positions + 1, dtype=np.int64), 1, empty, np.zeros((0, 1, 1), dtype=np.int32), 0.0, 0.0, 0)


def step_lengths(rng: np.random.Generator, groups: int, group_size: int, median: int, max_len: int) -> list[int]:
    out = []
    for _ in range(groups):
        prompt = int(rng.integers(64, 513))
        typical = median * rng.lognormal(0.0, 0.8)
        responses = np.clip(typical * rng.lognormal(0.0, 0.6, size=group_size), 1, max_len - prompt).astype(int)
        out += [prompt + int(r) - 1 for r in responses]
    return out


def previous_plan(samples: list[RLSample], dp: int, max_tokens: int, cp_sizes: list[int], budget: CPBudget):
    """The replaced plan, kept here to compare against: deal samples by positions, pack each share, size."""
    shares: list[list[RLSample]] = [[] for _ in range(dp)]
    load = [0] * dp
    for s in sorted(samples, key=lambda s: -s.positions):
        r = min(range(dp), key=lambda i: (load[i], i))
        shares[r].append(s)
        load[r] += s.positions
    return [[(b, choose_cp_size([s.positions for s in b], cp_sizes, budget))
             for b in best_fit_decreasing(share, max_tokens)] for share in shares]


def measure(plan, max_tokens: int, cp: int) -> tuple[float, float, int]:
    """(slowest rank's time, its ratio to the mean rank's, spread of the ranks' micro-batch counts); a rank's time as
    its `cp` CP ranks run its micro-batches (`dp_rank_time`)."""
    loads = [dp_rank_time([([s.positions for s in b], c) for b, c in rank], cp, max_tokens) for rank in plan]
    counts = [len(rank) for rank in plan]
    return max(loads), max(loads) / (sum(loads) / len(loads)), max(counts) - min(counts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--median", type=int, default=1500)
    p.add_argument("--max-len", type=int, default=32768)
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--cp-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--cp-max-tokens", type=int, default=8192)
    p.add_argument("--cp-max-attn", type=float, default=4096 * 8192)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    budget = CPBudget(a.cp_max_tokens, a.cp_max_attn)
    print(f"{'dp':>3} {'plan':>7} {'max/mean: mean':>15} {'p95':>7} {'worst':>7} {'heaviest/before: mean worst':>19} "
          f"{'mb count spread':>16}")
    for dp in a.dp:
        rng = np.random.default_rng(a.seed)
        steps = [[sample(n) for n in step_lengths(rng, a.groups, a.group_size, a.median, a.max_len)]
                 for _ in range(a.steps)]
        row = {"dp": dp, "steps": a.steps, "samples_per_step": a.groups * a.group_size, "median": a.median,
               "micro_batch_tokens": a.micro_batch_tokens, "cp_sizes": a.cp_sizes,
               "cp_max_tokens_per_rank": a.cp_max_tokens, "cp_max_attn_per_rank": a.cp_max_attn}
        heaviest_before = None
        for name, planner in (("before", previous_plan), ("after", plan_step)):
            got = [measure(planner(s, dp, a.micro_batch_tokens, a.cp_sizes, budget), a.micro_batch_tokens,
                           max(a.cp_sizes))
                   for s in steps]
            heaviest = np.array([h for h, _, _ in got])
            ratios = np.array([r for _, r, _ in got])
            heaviest_before = heaviest if heaviest_before is None else heaviest_before
            vs = heaviest / heaviest_before  # per step: the step time it predicts
            spread = max(c for _, _, c in got)
            row[name] = {"mean": round(float(ratios.mean()), 4), "p95": round(float(np.quantile(ratios, 0.95)), 4),
                         "worst": round(float(ratios.max()), 4), "heaviest_vs_before_mean": round(float(vs.mean()), 4),
                         "heaviest_vs_before_worst": round(float(vs.max()), 4),
                         "max_mb_count_spread": spread}
            print(f"{dp:>3} {name:>7} {ratios.mean():>15.4f} {np.quantile(ratios, 0.95):>7.4f} {ratios.max():>7.4f} "
                  f"{vs.mean():>12.4f} {vs.max():>6.4f} {spread:>16}")
        print(json.dumps(row))


if __name__ == "__main__":
    main()
