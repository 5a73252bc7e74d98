"""QK-norm + RoPE of the projected heads, forward + backward: the Triton kernels, and the compiled reference, against
the memory bandwidth floor.

    python bench/bench_head_norm_rope.py [--tokens 8192] [--heads 32] [--kv-heads 4] [--head-dim 128]

Rows: a device copy of the bytes the forward must move (read q, k; write them) as the floor; `kernels.head_norm_rope`
(what the model runs on CUDA); its torch reference as `model.compile` compiled it before the kernels (the cos/sin of
each token's angles computed inside the fused kernels); the same math with the cos/sin tables computed once outside
and passed in. Device time of calls queued back to back behind a GPU sleep (`queued_ms`), bf16 heads.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record import Table, add_record_argument  # noqa: E402
from kernels.head_norm_rope import _head_norm_rope_bwd_kernel, _head_norm_rope_fwd_kernel, head_norm_rope  # noqa: E402
from services.trainer.model.attention import compiled_head_norm_rope  # noqa: E402
from services.trainer.model.rope import rope_frequencies  # noqa: E402


def queued_ms(fn, reps: int = 50, rounds: int = 5) -> float:
    """Device milliseconds per call, the median of `rounds`: each round holds the stream in a GPU sleep (~0.17 s)
    while the host queues `reps` calls behind it, so the time is the device's even where the host takes longer per
    call than the kernels (the compiled rows' guards and autograd), as in training, where the GEMMs keep it ahead."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(300_000_000)  # GPU cycles
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def norm_rope_tables(q, k, q_scale, k_scale, eps, cos, sin):
    """head_norm_rope with the [T, 1, d/2] cos / sin tables given."""
    def one(x, scale):
        x = F.rms_norm(x, (x.shape[-1],), scale.to(x.dtype), eps)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return one(q, q_scale), one(k, k_scale)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    add_record_argument(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_head_norm_rope times GPU kernels and needs a CUDA GPU")
    dev, T, d = torch.device("cuda"), args.tokens, args.head_dim
    q = torch.randn(T, args.heads, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(T, args.kv_heads, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    qs, ks = (torch.ones(d, device=dev, requires_grad=True) for _ in range(2))
    pos = torch.arange(T, device=dev) % 4096
    inv_freq = rope_frequencies(d, 1e6, dev)
    gq, gk = torch.randn_like(q), torch.randn_like(k)

    inside = compiled_head_norm_rope()
    tables = torch.compile(norm_rope_tables)

    def run_kernels():
        a, b = head_norm_rope(q, k, qs, ks, 1e-6, pos, inv_freq)
        torch.autograd.grad((a, b), (q, k, qs, ks), (gq, gk))

    def run_inside():
        a, b = inside(q, k, qs, ks, 1e-6, pos, inv_freq)
        torch.autograd.grad((a, b), (q, k, qs, ks), (gq, gk))

    def run_tables():
        angles = pos.float()[:, None] * inv_freq[None, :]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        a, b = tables(q, k, qs, ks, 1e-6, cos, sin)
        torch.autograd.grad((a, b), (q, k, qs, ks), (gq, gk))

    src = torch.empty(q.numel() + k.numel(), device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    floor = queued_ms(lambda: dst.copy_(src))  # forward's bytes once (read + write); backward moves ~2x
    table = Table()
    table.line(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | q {tuple(q.shape)} k {tuple(k.shape)} "
               "bf16")
    table.line(f"{'variant':<44} {'fwd+bwd ms':>10}")
    table.line(f"{'copy of the forward bytes (floor: fwd only)':<44} {floor:10.3f}")
    with torch.no_grad():
        fwd = queued_ms(lambda: head_norm_rope(q, k, qs, ks, 1e-6, pos, inv_freq))
    table.line(f"{'triton kernels, forward only':<44} {fwd:10.3f}")
    for name, fn in (("triton kernels (kernels.head_norm_rope)", run_kernels),
                     ("compiled, cos/sin inside", run_inside), ("compiled, cos/sin tables passed in", run_tables)):
        table.line(f"{name:<44} {queued_ms(fn):10.3f}")
    for kernel in (_head_norm_rope_fwd_kernel, _head_norm_rope_bwd_kernel):
        table.line(f"{kernel.base_fn.__name__}: {kernel.best_config}")
    table.record(args.record, "QK-norm + RoPE kernels vs compiled torch")


if __name__ == "__main__":
    main()
