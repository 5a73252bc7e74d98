"""Output layer + cross-entropy: the unfused path against the chunked one (torch row step, Triton row step).

    python bench/bench_cross_entropy.py [--tokens 16384] [--hidden 2048] [--vocab 151936] [--mode autocast]
                                        [--chunks 0,2048,8192] [--warmup 3] [--reps 10]
    python bench/bench_cross_entropy.py --quick        # CPU-sized check that every variant runs and agrees

Each variant runs forward + backward of Σ token losses from hidden states h [T, H] and the output weight W [V, H]:
- unfused: `cross_entropy_sum(h @ W.T, labels)`, what the trainer does without `model.moe_kernels: [cross_entropy]`
  (the [T, V] logits, their fp32 copy and the saved log-softmax all alive);
- chunked torch / chunked triton: `kernels.cross_entropy`, one [chunk, V] block at a time (chunk 0: the default size).
`--mode autocast` is the trainer's setting (fp32 h and W, bf16 autocast, fp32 gradients); `bf16` and `fp32` use plain
tensors of that dtype. Labels are random with 5% ignored. Prints, per variant: the loss (all must agree), median
milliseconds of forward+backward (CUDA events; perf_counter on CPU), the speedup over unfused, and on CUDA the peak
memory allocated above the inputs. The `--quick` run on CPU times nothing of interest; it checks the bench itself.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record import Table, add_record_argument  # noqa: E402
from kernels._triton import interpreter_requested  # noqa: E402
from kernels.cross_entropy import (default_chunk_size, linear_cross_entropy_sum,  # noqa: E402
                                   linear_cross_entropy_sum_reference)
from services.trainer.model.loss import IGNORE_INDEX, cross_entropy_sum  # noqa: E402

DTYPES = {"autocast": torch.float32, "bf16": torch.bfloat16, "fp32": torch.float32}


def unfused(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return cross_entropy_sum(h @ w.T, labels)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def measure(fn: Callable[[], torch.Tensor], reset: Callable[[], None], dev: torch.device, warmup: int,
            reps: int) -> tuple[float, float, float]:
    """(loss, median ms, peak bytes above the inputs) of `reset(); fn()` then backward; `reset` drops the gradients."""
    loss = None
    for _ in range(warmup):
        reset()
        loss = fn()
        loss.backward()
    reset()
    sync(dev)
    times = []
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    for _ in range(reps):
        reset()
        start = time.perf_counter()
        if dev.type == "cuda":
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
        loss = fn()
        loss.backward()
        if dev.type == "cuda":
            ev1.record()
            torch.cuda.synchronize()
            times.append(ev0.elapsed_time(ev1))
        else:
            times.append((time.perf_counter() - start) * 1e3)
    peak = torch.cuda.max_memory_allocated() - base if dev.type == "cuda" else float("nan")
    return float(loss.detach()), statistics.median(times), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--mode", choices=sorted(DTYPES), default="autocast")
    parser.add_argument("--chunks", default="0,2048,8192", help="comma-separated chunk sizes (rows); 0: the default")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="CPU-sized shapes (T=512, H=64, V=5000), 1 warm-up, 3 reps")
    add_record_argument(parser)
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.hidden, args.vocab, args.warmup, args.reps = 512, 64, 5000, 1, 3
        args.chunks = "0,128"
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and not args.quick:
        raise SystemExit("bench_cross_entropy needs a CUDA GPU at these shapes; run with --quick to check it on CPU")

    T, H, V = args.tokens, args.hidden, args.vocab
    g = torch.Generator(device=dev).manual_seed(0)
    dtype = DTYPES[args.mode]
    h = torch.randn(T, H, device=dev, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(V, H, device=dev, generator=g, dtype=dtype) * H ** -0.5).requires_grad_()
    labels = torch.randint(0, V, (T,), device=dev, generator=g)
    labels[torch.rand(T, device=dev, generator=g) < 0.05] = IGNORE_INDEX
    compute = torch.bfloat16 if args.mode == "autocast" else dtype

    variants: list[tuple[str, Callable]] = [("unfused (F.cross_entropy on [T, V])", unfused)]
    triton_runs = dev.type == "cuda" or interpreter_requested()
    for chunk in (int(c) for c in args.chunks.split(",")):
        rows = min(chunk or default_chunk_size(V, compute), T)
        variants.append((f"chunked torch   chunk={rows}", lambda a, b, c, n=rows:
                         linear_cross_entropy_sum_reference(a, b, c, chunk_size=n)))
        if triton_runs:
            variants.append((f"chunked triton  chunk={rows}", lambda a, b, c, n=rows:
                             linear_cross_entropy_sum(a, b, c, chunk_size=n)))

    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU"
    table = Table()
    table.line(f"{name} | torch {torch.__version__} | T={T} H={H} V={V} {args.mode} | median of {args.reps}")
    if not triton_runs:
        table.line("(CPU: the Triton row step runs only on CUDA, or in Triton's interpreter with TRITON_INTERPRET=1)")
    header = f"{'variant':<38} {'loss':>14} {'fwd+bwd ms':>11} {'speedup':>8} {'peak GiB':>9}"
    table.line(header)
    table.line("-" * len(header))
    baseline = None

    def reset():
        h.grad = w.grad = None

    for label, fn in variants:
        def step(fn=fn):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.mode == "autocast"):
                return fn(h, w, labels)
        loss, ms, peak = measure(step, reset, dev, args.warmup, args.reps)
        baseline = baseline or ms
        memory = f"{peak / 2**30:9.2f}" if dev.type == "cuda" else f"{'-':>9}"
        table.line(f"{label:<38} {loss:14.4f} {ms:11.3f} {baseline / ms:7.2f}x {memory}")
        reset()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    table.record(args.record, "Chunked fp32 cross-entropy vs unfused")


if __name__ == "__main__":
    main()
