"""Each MoE data-path kernel against its torch reference, on one CUDA GPU, at Qwen3-30B-A3B shapes.

    python bench/bench_kernels.py [--tokens 16384] [--hidden 2048] [--experts 128] [--topk 8] [--ffn 768]
                                  [--dtype bf16] [--warmup 5] [--reps 20]

Times forward and forward+backward with CUDA events (median of `reps` after `warmup` runs, which also absorb Triton's
autotuning) and prints a table: milliseconds for Triton and torch, the speedup, and the forward's effective bandwidth
(bytes that must cross HBM at least once, over Triton's time). Exits with a message on a machine without CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record import Table, add_record_argument  # noqa: E402
from kernels.permute import permute, permute_reference  # noqa: E402
from kernels.router import router, router_reference  # noqa: E402
from kernels.swiglu import swiglu_prob, swiglu_prob_reference  # noqa: E402
from kernels.unpermute import unpermute, unpermute_reference  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Case:
    name: str
    triton: Callable[[], object]  # one forward
    torch: Callable[[], object]
    backward: Callable[[object], None]  # backward of what a forward returned
    fwd_bytes: int


# GPU cycles (~30 ms) each timed call waits behind: longer than the host takes to queue one call's kernels
HOST_SLACK_CYCLES = 50_000_000


def time_ms(fn: Callable[[], object], warmup: int, reps: int, before: Callable[[], object] | None = None) -> float:
    """Median device milliseconds of one call of `fn` over `reps`. Each call is queued behind a GPU sleep, so the
    host's time to launch it (Python, autograd, many small torch ops) is not counted: in training the host runs ahead
    of the device, and a host-bound timing would flatter a kernel against a reference of many small ops. `before`
    runs untimed ahead of each call (a barrier, so that the ranks of a collective start together)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(HOST_SLACK_CYCLES)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cases(T: int, h: int, E: int, k: int, f: int, dtype: torch.dtype, dev: torch.device) -> list[Case]:
    g = torch.Generator(device=dev).manual_seed(0)
    size = torch.tensor([], dtype=dtype).element_size()
    logits = torch.randn(T, E, device=dev, generator=g, requires_grad=True)
    routing = router_reference(logits.detach(), k, "softmax", normalise=True)
    indices, probs = routing.indices, routing.weights.detach().requires_grad_()
    hidden = torch.randn(T, h, device=dev, generator=g, dtype=dtype, requires_grad=True)
    row_id_map = permute_reference(hidden.detach(), indices, E).row_id_map
    expert_out = torch.randn(T * k, h, device=dev, generator=g, dtype=dtype, requires_grad=True)
    act_in = torch.randn(T * k, 2 * f, device=dev, generator=g, dtype=dtype, requires_grad=True)
    act_prob = torch.rand(T * k, device=dev, generator=g, requires_grad=True)
    grads = {
        "routing": (torch.randn(T, k, device=dev, generator=g), torch.randn(E, device=dev, generator=g)),
        "permute": torch.randn(T * k, h, device=dev, generator=g, dtype=dtype),
        "unpermute": torch.randn(T, h, device=dev, generator=g, dtype=dtype),
        "swiglu": torch.randn(T * k, f, device=dev, generator=g, dtype=dtype),
    }
    return [
        Case("router (softmax, top-k, stats)",
             lambda: router(logits, k, "softmax", normalise=True),
             lambda: router_reference(logits, k, "softmax", normalise=True),
             lambda r: torch.autograd.backward([r.weights, r.mean_probs], list(grads["routing"])),
             fwd_bytes=T * E * 4 + T * k * 12),
        Case("permute",
             lambda: permute(hidden, indices, E),
             lambda: permute_reference(hidden, indices, E),
             lambda p: p.permuted.backward(grads["permute"]),
             fwd_bytes=T * h * size + T * k * h * size),
        Case("unpermute (weighted combine)",
             lambda: unpermute(expert_out, row_id_map, probs),
             lambda: unpermute_reference(expert_out, row_id_map, probs),
             lambda out: out.backward(grads["unpermute"]),
             fwd_bytes=T * k * h * size + T * h * size),
        Case("swiglu_prob",
             lambda: swiglu_prob(act_in, act_prob),
             lambda: swiglu_prob_reference(act_in, act_prob),
             lambda out: out.backward(grads["swiglu"]),
             fwd_bytes=T * k * 3 * f * size),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=768, help="expert intermediate size f (SwiGLU input is 2f)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    add_record_argument(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA GPU (torch.cuda.is_available() is False here); the kernels' "
                         "correctness on CPU is covered by tests/test_kernels_*.py under Triton's interpreter")

    T, h, E, k, f = args.tokens, args.hidden, args.experts, args.topk, args.ffn
    table = Table()
    table.line(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | T={T} h={h} E={E} k={k} f={f} "
               f"{args.dtype}")
    header = f"{'kernel':<32} {'pass':<8} {'triton ms':>10} {'torch ms':>10} {'speedup':>8} {'triton GB/s':>12}"
    table.line(header)
    table.line("-" * len(header))
    for case in cases(T, h, E, k, f, DTYPES[args.dtype], torch.device("cuda")):
        for label, make in (("fwd", lambda fn: fn), ("fwd+bwd", lambda fn, c=case: (lambda: c.backward(fn())))):
            t_triton = time_ms(make(case.triton), args.warmup, args.reps)
            t_torch = time_ms(make(case.torch), args.warmup, args.reps)
            bandwidth = f"{case.fwd_bytes / t_triton / 1e6:12.0f}" if label == "fwd" else f"{'':>12}"
            table.line(f"{case.name:<32} {label:<8} {t_triton:10.3f} {t_torch:10.3f} {t_torch / t_triton:7.2f}x "
                       f"{bandwidth}")
        torch.cuda.empty_cache()
    table.record(args.record, "MoE data-path kernels vs their torch references")


if __name__ == "__main__":
    main()
