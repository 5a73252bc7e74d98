"""The rollout's decode attention: `kernels.decode_attention` (GQA) and `kernels.decode_latent_attention` (MLA) against
the torch paths they replaced (the slots' caches gathered, then SDPA under a mask; for MLA two batched GEMMs around a
masked softmax).

    python bench/bench_decode_attention.py [--batch 64 256] [--max-len 128 1024] [--reps 20] [--record bench/RESULTS.md]

Shapes: GQA at Qwen3-30B-A3B's attention (32 query heads, 4 key/value heads, head dim 128); MLA at DeepSeek-V3's
(128 heads over one latent of 512 and a RoPE key of 64, kv_b_proj absorbed: the queries are given in latent space).
bf16, a cache of 257 slots (a rollout batch of 256 and the spare one); each row on its own slot at a position drawn
uniformly below `max_len`, the torch paths gathering the step's bucket (`max_len` positions). Device milliseconds per
call (`bench_kernels.time_ms`: each call queued behind a GPU sleep, median of `reps`); GB/s counts the cache each row
attends to (keys and values; MLA: latents and RoPE keys, read once).
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
from kernels.decode_latent_attention import decode_latent_attention, decode_latent_attention_reference  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--max-len", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--reps", type=int, default=20)
    add_record_argument(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_attention times GPU kernels and needs a CUDA GPU")
    dev, slots, bf16 = torch.device("cuda"), 257, torch.bfloat16
    gen = torch.Generator(dev).manual_seed(0)
    table = Table()
    table.line(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | GQA: 32 heads, 4 kv heads, dim 128 | "
               f"MLA: 128 heads, latent 512 + rope 64 | bf16 | device ms, median of {args.reps}")
    table.line(f"{'attention':>9}  {'batch':>6}  {'max len':>7}  {'torch path':>10}  {'kernel':>8}  {'speedup':>7}  "
               "kernel GB/s")

    def rnd(*shape):
        return torch.randn(*shape, device=dev, generator=gen).to(bf16)

    for max_len in args.max_len:
        gqa_cache = rnd(slots, 4, max_len, 128), rnd(slots, 4, max_len, 128)
        mla_cache = rnd(slots, max_len, 512), rnd(slots, max_len, 64)
        for batch in args.batch:
            slot = torch.randperm(slots - 1, device=dev, generator=gen)[:batch]
            pos = torch.randint(0, max_len, (batch,), device=dev, generator=gen)
            gqa_q, mla_q = (rnd(batch, 32, 128),), (rnd(batch, 128, 512), rnd(batch, 128, 64))
            for name, fast, reference, inputs, per_position, extra in (
                    ("GQA", decode_attention, decode_attention_reference, gqa_q + gqa_cache, 4 * 2 * 128, ()),
                    ("MLA", decode_latent_attention, decode_latent_attention_reference, mla_q + mla_cache, 512 + 64,
                     (192 ** -0.5,))):
                args_ = (*inputs, slot, pos, max_len, *extra)
                t_torch = time_ms(lambda: reference(*args_), 3, args.reps)
                t_kernel = time_ms(lambda: fast(*args_), 3, args.reps)
                read = int((pos + 1).sum()) * per_position * 2
                table.line(f"{name:>9}  {batch:>6}  {max_len:>7}  {t_torch:>10.3f}  {t_kernel:>8.3f}  "
                           f"{t_torch / t_kernel:>6.1f}x  {read / t_kernel / 1e6:,.0f}")
    table.record(args.record, "The rollout's decode attention (GQA and MLA kernels) against the torch paths")


if __name__ == "__main__":
    main()
