"""The rollout's decode attention: `kernels.decode_attention` against the torch path it replaced (the slots' caches
gathered, then SDPA under a mask).

    python bench/bench_decode_attention.py [--batch 64 256] [--max-len 128 1024] [--reps 20] [--record bench/RESULTS.md]

Qwen3-30B-A3B's attention shape (32 query heads, 4 key/value heads, head dim 128), bf16, a cache of 257 slots (a
rollout batch of 256 and the spare one); each row on its own slot at a position drawn uniformly below `max_len`, the
torch path gathering the step's bucket (`max_len` positions). Device milliseconds per call (`bench_kernels.time_ms`:
each call queued behind a GPU sleep, median of `reps`); GB/s counts the keys and values each row attends to.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_kernels import time_ms  # noqa: E402
from bench.record import Table, add_record_argument  # noqa: E402
from kernels.decode_attention import decode_attention, decode_attention_reference  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--max-len", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--reps", type=int, default=20)
    add_record_argument(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_attention times GPU kernels and needs a CUDA GPU")
    dev, heads, kv_heads, d, slots = torch.device("cuda"), 32, 4, 128, 257
    gen = torch.Generator(dev).manual_seed(0)
    table = Table()
    table.line(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {heads} heads, {kv_heads} kv heads, "
               f"dim {d}, bf16 | device ms, median of {args.reps}")
    table.line(f"{'batch':>6}  {'max len':>7}  {'torch path':>10}  {'kernel':>8}  {'speedup':>7}  kernel GB/s")
    for max_len in args.max_len:
        k_cache, v_cache = (torch.randn(slots, kv_heads, max_len, d, device=dev, generator=gen).to(torch.bfloat16)
                            for _ in range(2))
        for batch in args.batch:
            q = torch.randn(batch, heads, d, device=dev, generator=gen).to(torch.bfloat16)
            slot = torch.randperm(slots - 1, device=dev, generator=gen)[:batch]
            pos = torch.randint(0, max_len, (batch,), device=dev, generator=gen)
            t_torch = time_ms(lambda: decode_attention_reference(q, k_cache, v_cache, slot, pos, max_len), 3, args.reps)
            t_kernel = time_ms(lambda: decode_attention(q, k_cache, v_cache, slot, pos, max_len), 3, args.reps)
            read = int((pos + 1).sum()) * kv_heads * 2 * d * 2
            table.line(f"{batch:>6}  {max_len:>7}  {t_torch:>10.3f}  {t_kernel:>8.3f}  {t_torch / t_kernel:>6.1f}x  "
                       f"{read / t_kernel / 1e6:,.0f}")
    table.record(args.record, "The rollout's decode attention: kernels.decode_attention against the torch path")


if __name__ == "__main__":
    main()
