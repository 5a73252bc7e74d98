"""The routed experts' GEMMs with few rows per expert (a rollout decode step): `kernels.grouped_mm_small` against
`torch._grouped_mm`.

    python bench/bench_grouped_mm_small.py [--rows-per-expert 4 8 16 32 64] [--reps 20] [--record bench/RESULTS.md]

Qwen3-30B-A3B's experts (128; gate/up [2048, 1536], down [768, 2048]), bf16; each of rows-per-expert x 128 rows
assigned to a random expert (as routing spreads a decode batch). Device milliseconds per call (`bench_kernels.time_ms`:
each call queued behind a GPU sleep, median of `reps`); GB/s counts the weights of the experts that have rows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_kernels import time_ms  # noqa: E402
from bench.record import Table, add_record_argument  # noqa: E402
from kernels.grouped_mm_small import grouped_mm_small  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows-per-expert", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument("--reps", type=int, default=20)
    add_record_argument(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_grouped_mm_small times GPU kernels and needs a CUDA GPU")
    dev, experts = torch.device("cuda"), 128
    gen = torch.Generator(dev).manual_seed(0)
    table = Table()
    table.line(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {experts} experts, bf16 | device ms, "
               f"median of {args.reps}")
    table.line(f"{'GEMM':<8}  {'rows/expert':>11}  {'_grouped_mm':>11}  {'kernel':>8}  {'speedup':>7}  kernel GB/s")
    for name, K, N in (("gate/up", 2048, 1536), ("down", 768, 2048)):
        b = (torch.randn(experts, K, N, device=dev, generator=gen) / K ** 0.5).to(torch.bfloat16)
        for per in args.rows_per_expert:
            rows = per * experts
            counts = torch.bincount(torch.randint(0, experts, (rows,), device=dev, generator=gen), minlength=experts)
            offs = counts.cumsum(0).to(torch.int32)
            a = torch.randn(rows, K, device=dev, generator=gen).to(torch.bfloat16)
            t_lib = time_ms(lambda: torch._grouped_mm(a, b, offs=offs), 3, args.reps)
            t_kernel = time_ms(lambda: grouped_mm_small(a, b, offs), 3, args.reps)
            weights = int((counts > 0).sum()) * K * N * 2
            table.line(f"{name:<8}  {per:>11}  {t_lib:>11.3f}  {t_kernel:>8.3f}  {t_lib / t_kernel:>6.2f}x  "
                       f"{weights / t_kernel / 1e6:,.0f}")
    table.record(args.record, "Few rows per expert: kernels.grouped_mm_small against torch._grouped_mm")


if __name__ == "__main__":
    main()
