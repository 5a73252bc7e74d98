"""The experts' grouped GEMM in FP8 (kernels/fp8_grouped_mm.py) against bf16 torch._grouped_mm, on one CUDA GPU.

    python bench/bench_fp8_grouped_mm.py [--shapes qwen3,qwen3-uneven,qwen3-down,mixtral] [--warmup 3] [--reps 10]

Shapes: Qwen3-30B-A3B (128 experts, 1024 tokens each; gate/up K=2048 N=1536, down K=768 N=2048; "uneven": the same
tokens routed by a Zipf-like law, some experts empty) and Mixtral-8x7B (8 experts, 4096 tokens each, K=4096 N=14336).
Rows per shape:
- bf16 grouped_mm: torch._grouped_mm forward, and forward+backward through its autograd;
- scaled_grouped_mm rowwise: torch._scaled_grouped_mm with e4m3 operands, row scales for x and per-column scales for
  each expert's weight (quantised outside the timing), where this torch has it;
- fp8 tensorwise / blockwise: our kernel alone on quantised operands ("gemm": as in the linear's forward, i.e.
  tensorwise with fast accumulation; "gemm split": tensorwise with split accumulation, as in the linear's dgrad), with
  the quantisation of x and w included ("gemm+quant", the autograd forward), and forward+backward of
  fp8_grouped_linear ("fwd+bwd": FP8 dgrad, bf16 wgrad).
TFLOP/s counts 2*M*K*N per GEMM (3 GEMMs for fwd+bwd), over the median of `reps` CUDA-event timings after `warmup`
runs (which absorb Triton's autotuning); "of dense" is that over a dense bf16 torch.mm of the same M, K, N measured in
the same run. "err" is max|out - bf16| / max|bf16| of the forward output against bf16 torch._grouped_mm.
Prints one table; `--record bench/RESULTS.md` appends it there with machine, command and commit.
Exits with a message without CUDA.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_kernels import time_ms  # noqa: E402
from bench.record import Table, add_record_argument  # noqa: E402
from kernels.fp8_grouped_mm import _fp8_grouped_mm_kernel, fp8_grouped_linear, fp8_grouped_mm  # noqa: E402
from kernels.fp8_quantize import FP8, FP8_MAX, RECIPES, quantize_rows, quantize_weight  # noqa: E402

# name: (experts, tokens per expert, K, N, uneven)
SHAPES = {
    "qwen3": (128, 1024, 2048, 1536, False),
    "qwen3-uneven": (128, 1024, 2048, 1536, True),
    "qwen3-down": (128, 1024, 768, 2048, False),
    "mixtral": (8, 4096, 4096, 14336, False),
}


def token_counts(E: int, per_expert: int, uneven: bool) -> torch.Tensor:
    total = E * per_expert
    if not uneven:
        return torch.full((E,), per_expert)
    weights = 1.0 / torch.arange(1, E + 1).float() ** 1.2  # Zipf-like: a few hot experts, a long cold tail
    weights[torch.randperm(E, generator=torch.Generator().manual_seed(0))[: E // 16]] = 0  # some experts empty
    counts = (weights / weights.sum() * total).floor().long()
    counts[0] += total - counts.sum()
    return counts


def scaled_grouped_mm_case(x, w, offs):
    """torch._scaled_grouped_mm rowwise: x [M, K] row scales, w [E, K, N] column scales; None if unavailable."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return None
    x_scale = x.float().abs().amax(1).clamp(min=1e-12) / FP8_MAX
    w_scale = w.float().abs().amax(1).clamp(min=1e-12) / FP8_MAX  # [E, N]
    xq = (x.float() / x_scale[:, None]).to(FP8)
    wq = (w.float() / w_scale[:, None, :]).to(FP8).transpose(1, 2).contiguous().transpose(1, 2)  # column-major
    fn = lambda: torch._scaled_grouped_mm(xq, wq, x_scale, w_scale, offs=offs, out_dtype=torch.bfloat16)  # noqa: E731
    try:
        fn()
    except (RuntimeError, TypeError) as e:
        print(f"  (torch._scaled_grouped_mm unavailable here: {str(e).splitlines()[0][:100]})")
        return None
    return fn


def run_shape(name: str, warmup: int, reps: int, table: Table) -> None:
    E, per_expert, K, N, uneven = SHAPES[name]
    counts = token_counts(E, per_expert, uneven)
    M = int(counts.sum())
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    offs = counts.cumsum(0).to(device=dev, dtype=torch.int32)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(E, K, N, device=dev, generator=g) * K ** -0.5).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(M, N, device=dev, dtype=torch.bfloat16, generator=g)
    flops = 2 * M * K * N

    dense_a, dense_b = x.detach()[:, :K], w.detach()[0]
    dense = time_ms(lambda: torch.mm(dense_a, dense_b), warmup, reps)
    with torch.no_grad():
        ref = torch._grouped_mm(x, w, offs=offs).float()

    def fwd_bwd(fn):
        def step():
            x.grad = w.grad = None
            fn().backward(grad)
        return step

    rows: list[tuple[str, str, float, int, torch.Tensor | None]] = []
    with torch.no_grad():
        rows.append(("bf16 grouped_mm", "gemm", time_ms(lambda: torch._grouped_mm(x, w, offs=offs), warmup, reps),
                     flops, None))
        scaled = scaled_grouped_mm_case(x.detach(), w.detach(), offs)
        if scaled is not None:
            rows.append(("scaled_grouped_mm rowwise", "gemm", time_ms(scaled, warmup, reps), flops, scaled()))
    rows.append(("bf16 grouped_mm", "fwd+bwd",
                 time_ms(fwd_bwd(lambda: torch._grouped_mm(x, w, offs=offs)), warmup, reps), 3 * flops, None))
    for recipe in RECIPES:
        label = f"fp8 {recipe}"
        with torch.no_grad():
            xq, xs = quantize_rows(x, recipe)
            _, wq_t, ws = quantize_weight(w, recipe)
            for fast in (True, False) if recipe == "tensorwise" else (False,):  # the forward's, and dgrad's
                gemm = lambda: fp8_grouped_mm(xq, xs, wq_t, ws.transpose(1, 2), offs, recipe, fast)  # noqa: E731
                what = "gemm" if fast or recipe == "blockwise" else "gemm split"
                rows.append((label, what, time_ms(gemm, warmup, reps), flops, gemm()))
            linear = lambda: fp8_grouped_linear(x, w, offs, recipe)  # noqa: E731
            rows.append((label, "gemm+quant", time_ms(linear, warmup, reps), flops, None))
        rows.append((label, "fwd+bwd", time_ms(fwd_bwd(linear), warmup, reps), 3 * flops, None))

    table.line(f"{name}: E={E} M={M} K={K} N={N}{' uneven' if uneven else ''} | dense bf16 mm {dense:.3f} ms = "
               f"{flops / dense / 1e9:.0f} TFLOP/s")
    for label, what, ms, fl, out in rows:
        tflops = fl / ms / 1e9
        err = f"{((out.float() - ref).abs().max() / ref.abs().max()).item():.2e}" if out is not None else ""
        table.line(f"  {label:<27} {what:<11} {ms:9.3f} {tflops:9.0f} {tflops / (flops / dense / 1e9):8.2f} {err:>9}")
    del x, w, grad
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {list(SHAPES)}")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    add_record_argument(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_grouped_mm needs a CUDA GPU (torch.cuda.is_available() is False here); the "
                         "kernel's correctness on CPU is covered by tests/test_kernels_fp8_grouped_mm.py")
    names = args.shapes.split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown --shapes {unknown}; choose among {list(SHAPES)}")
    table = Table()
    table.line(f"{torch.cuda.get_device_name()} | torch {torch.__version__}")
    table.line(f"  {'variant':<27} {'pass':<11} {'ms':>9} {'TFLOP/s':>9} {'of dense':>8} {'err':>9}")
    for name in names:
        run_shape(name, args.warmup, args.reps, table)
    table.line("tiles the autotuner chose (N, K, E, blockwise, fast accumulation: BLOCK_M x BLOCK_N, warps, stages, "
               "band of row tiles)")
    for key, c in _fp8_grouped_mm_kernel.cache.items():
        table.line(f"  {key[:5]}: {c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']}, {c.num_warps}, {c.num_stages}, "
                   f"{c.kwargs['BAND']}")
    table.record(args.record, "FP8 grouped GEMM for the experts vs bf16 torch._grouped_mm")


if __name__ == "__main__":
    main()
