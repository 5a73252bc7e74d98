"""AdamW with fp32 master weights and a bf16 model copy: torch's fused step against `kernels.adamw`, on one CUDA GPU.

    python bench/bench_adamw.py [--numel 1_000_000_000] [--chunks 64] [--warmup 5] [--reps 20]

One optimizer step over N elements, each variant dividing the gradient by a device-side clip divisor, as the trainer
does (torch's fused kernel then also writes the divided gradient back):
  (a) fp32 params: `torch._fused_adamw_` over fp32 params, grads and moments — today's fp32-parameter step;
  (b) bf16 params, library path: upcast the bf16 gradient into an fp32 buffer, `torch._fused_adamw_` on the fp32
      master, then `param.copy_(master)`;
  (c) `adamw_step`: fp32 master and moments, bf16 grad, bf16 param written in the same pass;
  (d) `adamw_step` with bf16 moments;
  (e) `adamw_step` with bf16 moments and the master as int16 remainders of the bf16 param (the trainer's bf16 path).
(a) and (b) give torch lists of `--chunks` equal views of flat buffers (a model's parameters, or the distributed
optimizer's views of its shards); the upcast and the copy of (b) are one flat call each, and (c), (d) are one call
over the flat buffers. Prints the median milliseconds per step (CUDA events, after `warmup` steps, which also absorb
Triton's autotuning), the bytes each variant moves per element, its bandwidth, and that as a fraction of a
device-to-device copy (`dst.copy_(src)` over N fp32 elements) timed in the same run. Variants run one after another,
each freeing its buffers: the peak is (c)'s 16 B per element plus the 14 B its first call clones while autotuning.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_kernels import time_ms  # noqa: E402  (bench/ is the script's directory)
from bench.record import Table, add_record_argument  # noqa: E402
from kernels.adamw import adamw_step, split_master  # noqa: E402

HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
STEP = 10


def fused_adamw(master, grad, exp_avg, exp_avg_sq, chunks: int, divisor: torch.Tensor) -> Callable[[], None]:
    """torch._fused_adamw_ over `chunks` views of each flat buffer, as the trainer calls it."""
    lists = [list(t.chunk(chunks)) for t in (master, grad, exp_avg, exp_avg_sq)]
    step = torch.tensor(float(STEP), device=master.device)
    h = HYPER
    return lambda: torch._fused_adamw_(*lists, [], [step] * len(lists[0]), lr=h["lr"], beta1=h["beta1"],
                                       beta2=h["beta2"], weight_decay=h["weight_decay"], eps=h["eps"],
                                       amsgrad=False, maximize=False, grad_scale=divisor, found_inf=None)


def variants(n: int, chunks: int, dev: torch.device) -> list[tuple[str, int, Callable[[], Callable[[], None]]]]:
    """(label, bytes moved per element, builder); a builder allocates the variant's buffers and returns its step."""
    f32, bf16 = torch.float32, torch.bfloat16
    divisor = torch.tensor(1.5, device=dev)

    def buffers(grad_dtype, moment_dtype):
        master = torch.randn(n, device=dev)
        grad = torch.randn(n, device=dev, dtype=grad_dtype)
        return master, grad, torch.zeros(n, device=dev, dtype=moment_dtype), torch.ones(n, device=dev,
                                                                                        dtype=moment_dtype)

    def torch_fp32():
        return fused_adamw(*buffers(f32, f32), chunks, divisor)

    def torch_bf16_params():
        master, grad, exp_avg, exp_avg_sq = buffers(bf16, f32)
        grad32, param = torch.empty(n, device=dev), master.to(bf16)
        step = fused_adamw(master, grad32, exp_avg, exp_avg_sq, chunks, divisor)

        def run():
            grad32.copy_(grad)
            step()
            param.copy_(master)
        return run

    def ours(moment_dtype):
        master, grad, exp_avg, exp_avg_sq = buffers(bf16, moment_dtype)
        param = master.to(bf16)
        return lambda: adamw_step(master, grad, exp_avg, exp_avg_sq, param, **HYPER, step=STEP, grad_divisor=divisor)

    def remainders():
        master, grad, exp_avg, exp_avg_sq = buffers(bf16, bf16)
        param, remainder = split_master(master)
        del master
        return lambda: adamw_step(remainder, grad, exp_avg, exp_avg_sq, param, **HYPER, step=STEP,
                                  grad_divisor=divisor)

    # bytes per element: master r+w 8, grad r (+w when torch divides it in place), moments r+w, param w
    return [
        ("(a) torch fused, fp32 params", 8 + 4 + 4 + 16, torch_fp32),
        ("(b) torch: upcast + fused + copy", (2 + 4) + (8 + 4 + 4 + 16) + (4 + 2), torch_bf16_params),
        ("(c) adamw_step, fp32 moments", 8 + 2 + 16 + 2, lambda: ours(f32)),
        ("(d) adamw_step, bf16 moments", 8 + 2 + 8 + 2, lambda: ours(bf16)),
        ("(e) same, remainders", 4 + 2 + 8 + 4, remainders),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=lambda s: int(float(s.replace("_", ""))), default=1_000_000_000,
                        help="elements per optimizer step (accepts 1e9 and 1_000_000_000)")
    parser.add_argument("--chunks", type=int, default=64, help="tensors in torch's lists for (a) and (b)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    add_record_argument(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_adamw times GPU memory bandwidth and needs a CUDA GPU; on CPU only --help works")
    dev, n = torch.device("cuda"), args.numel

    src, dst = torch.randn(n, device=dev), torch.empty(n, device=dev)
    copy_gbs = 8 * n / time_ms(lambda: dst.copy_(src), args.warmup, args.reps) / 1e6
    del src, dst
    torch.cuda.empty_cache()

    table = Table()
    table.line(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | N={n:,} | (a), (b): {args.chunks} "
               f"tensors | median of {args.reps} | d2d copy {copy_gbs:.0f} GB/s")
    header = f"{'variant':<34} {'ms':>9} {'B/elem':>7} {'GB/s':>7} {'of copy':>8} {'vs (b)':>7}"
    table.line(header)
    table.line("-" * len(header))
    baseline = None
    for label, bytes_per_elem, build in variants(n, args.chunks, dev):
        ms = time_ms(build(), args.warmup, args.reps)  # the step's buffers die with its closure
        torch.cuda.empty_cache()
        gbs = bytes_per_elem * n / ms / 1e6
        baseline = ms if label.startswith("(b)") else baseline
        speedup = f"{baseline / ms:6.2f}x" if baseline else f"{'-':>7}"
        table.line(f"{label:<34} {ms:9.2f} {bytes_per_elem:7d} {gbs:7.0f} {gbs / copy_gbs:8.1%} {speedup}")

    table.record(args.record, "AdamW kernel vs torch's AdamW paths")

if __name__ == "__main__":
    main()
