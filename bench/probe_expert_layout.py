"""Probe: does the experts' weight layout change `torch._grouped_mm`'s rate? (CUDA only)

    python bench/probe_expert_layout.py [--tokens 16384] [--reps 20]

The layer stores w13 as [E, h, 2f] and w2 as [E, f, h] (N contiguous: the forward's B operand is MN-major). This times
the six GEMMs of the experts' forward and backward, as `torch._grouped_mm`'s autograd runs them, for that layout and
for weights stored transposed ([E, 2f, h], [E, h, f]: the forward's B operand K-major), at Qwen3-30B-A3B shapes with
routing counts drawn as the layer's random router gives them (top-8 of 128 distinct experts per token).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_kernels import time_ms  # noqa: E402


def counts_for(tokens: int, experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    choice = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices
    return torch.bincount(choice.flatten(), minlength=experts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    E, h, f, k = 128, 2048, 768, 8
    dev, bf = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    counts = counts_for(args.tokens, E, k, gen)
    offs = counts.cumsum(0).to(device=dev, dtype=torch.int32)
    M = int(counts.sum())
    x = torch.randn(M, h, device=dev, dtype=bf)
    a = torch.randn(M, f, device=dev, dtype=bf)
    dh13 = torch.randn(M, 2 * f, device=dev, dtype=bf)
    dy = torch.randn(M, h, device=dev, dtype=bf)
    dense_a = torch.randn(8192, 8192, device=dev, dtype=bf)
    dense_ms = time_ms(lambda: dense_a @ dense_a, warmup=3, reps=args.reps)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | M={M} h={h} f={f} E={E} | counts "
          f"{int(counts.min())}..{int(counts.max())} | dense 8192^3 {2 * 8192 ** 3 / dense_ms / 1e9:.0f} TFLOP/s")
    gm = torch._grouped_mm
    layouts = {
        "[E,h,2f] / [E,f,h] (now)": (torch.randn(E, h, 2 * f, device=dev, dtype=bf),
                                     torch.randn(E, f, h, device=dev, dtype=bf), False),
        "[E,2f,h] / [E,h,f] (transposed)": (torch.randn(E, 2 * f, h, device=dev, dtype=bf),
                                            torch.randn(E, h, f, device=dev, dtype=bf), True),
    }
    for name, (w13, w2, t) in layouts.items():
        W13, W2 = (w13.mT, w2.mT) if t else (w13, w2)  # [E, K, N] views either way
        gemms = {
            "fwd  x @ w13": (lambda: gm(x, W13, offs=offs), M * h * 2 * f),
            "fwd  a @ w2": (lambda: gm(a, W2, offs=offs), M * f * h),
            "dgrad dy @ w2^T": (lambda: gm(dy, W2.mT, offs=offs), M * f * h),
            "dgrad dh13 @ w13^T": (lambda: gm(dh13, W13.mT, offs=offs), M * h * 2 * f),
            # wgrad in the stored layout: [E, K, N] as x^T dY, or [E, N, K] as dY^T x
            "wgrad w2": ((lambda: gm(dy.t(), a, offs=offs)) if t else (lambda: gm(a.t(), dy, offs=offs)), M * f * h),
            "wgrad w13": ((lambda: gm(dh13.t(), x, offs=offs)) if t else (lambda: gm(x.t(), dh13, offs=offs)),
                          M * h * 2 * f),
        }
        total = 0.0
        print(name)
        for label, (fn, macs) in gemms.items():
            ms = time_ms(fn, warmup=3, reps=args.reps)
            total += ms
            print(f"  {label:<22} {ms:7.3f} ms  {2 * macs / ms / 1e9:6.0f} TFLOP/s")
        print(f"  {'six GEMMs':<22} {total:7.3f} ms")


if __name__ == "__main__":
    main()
