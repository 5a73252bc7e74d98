"""The FP8 experts' quantisers (kernels/fp8_grouped_mm.py) against the memory bandwidth, on one CUDA GPU.

    python bench/bench_fp8_quantisers.py [--warmup 3] [--reps 20]

At the Qwen3-30B-A3B step's shapes (8,192 tokens, top-8: 65,536 routed rows; h=2048, ffn=768, 128 experts):
- `quantize_rows` of bf16 rows [65536, K] for K = 2048 (the gate/up GEMM's input, and the down GEMM's dY), 768 (the
  down GEMM's input) and 1536 (the gate/up GEMM's dY), both recipes: bytes moved (read 2, write 1 per value, plus
  the scales) over the time;
- `quantize_weight` of the bf16 expert weights w13 [128, 2048, 1536] and w2 [128, 768, 2048], both recipes: time, and
  the time its traffic would take at the copy bandwidth (tensorwise reads the weight twice, once for the per-expert
  amax; both write e4m3 in two layouts, the second copied from the first's bytes);
against the bandwidth of a 1 GiB device-to-device copy measured in the same run. Medians of CUDA-event timings.
Prints one table; `--record bench/RESULTS.md` appends it there with machine, command and commit. Exits without CUDA.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_kernels import time_ms  # noqa: E402
from bench.record import Table, add_record_argument  # noqa: E402
from kernels.fp8_quantize import RECIPES, SCALE_BLOCK, quantize_rows, quantize_weight  # noqa: E402

ROWS = 65536
ROW_WIDTHS = (2048, 768, 1536)
WEIGHTS = {"w13": (128, 2048, 1536), "w2": (128, 768, 2048)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    add_record_argument(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_quantisers needs a CUDA device")
    dev = torch.device("cuda")
    seconds = lambda fn: time_ms(fn, args.warmup, args.reps) * 1e-3  # noqa: E731
    big = torch.empty(2**30, dtype=torch.uint8, device=dev)
    bw = 2 * big.numel() / seconds(big.clone)  # bytes/s, read + write
    del big
    table = Table()
    table.line(f"device {torch.cuda.get_device_name()} | copy bandwidth (1 GiB clone) {bw / 1e9:,.0f} GB/s")
    table.line(f"{'case':<44}{'recipe':<12}{'us':>8}{'GB/s':>8}{'of copy':>9}")
    for K in ROW_WIDTHS:
        x = torch.randn(ROWS, K, device=dev, dtype=torch.bfloat16)
        for recipe in RECIPES:
            scales = 1 if recipe == "tensorwise" else -(-K // SCALE_BLOCK)
            nbytes = ROWS * K * 3 + ROWS * scales * 4
            t = seconds(lambda: quantize_rows(x, recipe))
            table.line(f"{f'quantize_rows [{ROWS}, {K}] bf16':<44}{recipe:<12}{t * 1e6:>8.0f}{nbytes / t / 1e9:>8,.0f}"
                       f"{nbytes / t / bw:>9.0%}")
    for name, shape in WEIGHTS.items():
        w = torch.randn(*shape, device=dev, dtype=torch.bfloat16) * 0.02
        n = w.numel()
        for recipe in RECIPES:
            # tensorwise: amax read (2 B); then both: read 2 B, write 1 B; read 1 B, write 1 B (the transposed copy)
            nbytes = (2 * n if recipe == "tensorwise" else 0) + 3 * n + 2 * n
            t = seconds(lambda: quantize_weight(w, recipe))
            table.line(f"{f'quantize_weight {name} {list(shape)} bf16':<44}{recipe:<12}{t * 1e6:>8.0f}"
                       f"{nbytes / t / 1e9:>8,.0f}{nbytes / t / bw:>9.0%}")
    table.record(args.record, "FP8 quantisers vs the copy bandwidth")


if __name__ == "__main__":
    main()
