"""How evenly the corpus stream's dealing spreads the dp ranks' time under dynamic CP (CPU only: it plans, it runs
no model).

    python bench/bench_cp_deal.py [--steps 300] [--seq-len 8192] [--cp 4] [--cp-sizes 1 2 4] [--dp 2 4] [--grad-accum 4 8]

Micro-batches: sequences of `--seq-len` tokens filled with documents of log-normal lengths (median e^6.5 ≈ 665 tokens,
sigma 1.3, at least 16; the last cut to fit), each sized by `cp_sizing.choose_cp_size` under an attention budget of
seq_len² / 8 per rank (so short-document sequences run on one rank, long-document ones on 2 or 4), dealt `grad_accum`
per dp rank by `cp_sizing.deal_by_cost` over a cost:

- "work / c": the micro-batch's work divided by its CP size (the cost model before this bench);
- "work": `cp_sizing.work`, the same for every size.

A rank's time is what the trainer runs, not the cost model: each of its `--cp` CP ranks runs the micro-batches
`cp_sizing.block_share` (the trainer's `cp_share`) gives it, each at work / c; the dp rank takes the slowest CP
rank's time (`cp_sizing.dp_rank_time`). Printed: the slowest dp rank's time over the ideal (all work / (dp·cp)),
mean and worst over the steps, per dealing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.dataloader.cp_sizing import CPBudget, choose_cp_size, deal_by_cost, dp_rank_time, work  # noqa: E402


def sequence(rng: np.random.Generator, seq_len: int) -> list[int]:
    lengths: list[int] = []
    while sum(lengths) < seq_len:
        lengths.append(int(min(seq_len - sum(lengths), max(16, rng.lognormal(6.5, 1.3)))))
    return lengths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--cp-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--grad-accum", type=int, nargs="+", default=[4, 8])
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    budget = CPBudget(max_attn_per_rank=a.seq_len ** 2 / 8)
    costs = {"work / c": lambda lengths, c: work(lengths, a.seq_len) / c,
             "work": lambda lengths, c: work(lengths, a.seq_len)}
    print(f"{'dp':>3} {'ga':>3} {'dealt by':>9} {'slowest/ideal: mean':>20} {'worst':>7}   sizes")
    for dp in a.dp:
        for ga in a.grad_accum:
            rng = np.random.default_rng(a.seed)
            steps = []
            for _ in range(a.steps):
                seqs = [sequence(rng, a.seq_len) for _ in range(dp * ga)]
                steps.append([(s, choose_cp_size(s, a.cp_sizes, budget)) for s in seqs])
            sizes = np.bincount([c for step in steps for _, c in step], minlength=max(a.cp_sizes) + 1)
            row = {"dp": dp, "grad_accum": ga, "cp": a.cp, "cp_sizes": a.cp_sizes, "seq_len": a.seq_len,
                   "steps": a.steps, "size_counts": {c: int(sizes[c]) for c in a.cp_sizes}}
            for name, cost in costs.items():
                ratios = []
                for step in steps:
                    groups = deal_by_cost([cost(lengths, c) for lengths, c in step], dp, ga)
                    ideal = sum(work(lengths, a.seq_len) for lengths, _ in step) / (dp * a.cp)
                    ratios.append(max(dp_rank_time([step[i] for i in g], a.cp, a.seq_len) for g in groups) / ideal)
                r = np.array(ratios)
                row[name] = {"mean": round(float(r.mean()), 4), "worst": round(float(r.max()), 4)}
                print(f"{dp:>3} {ga:>3} {name:>9} {r.mean():>20.4f} {r.max():>7.4f}   {row['size_counts']}")
            print(json.dumps(row))


if __name__ == "__main__":
    main()
