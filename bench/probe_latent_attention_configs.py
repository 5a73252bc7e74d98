"""Every (heads, positions, warps, stages) config of kernels/decode_latent_attention.py's kernel timed alone at a few
decode shapes: how its autotuning set was chosen (bench/RESULTS.md, "MLA's decode attention reading the latent cache
in place").

    python bench/probe_latent_attention_configs.py [--reps 20] [--top 6]

DeepSeek-V3's shape (128 heads, latent 512, RoPE key 64), bf16, a cache of 257 slots; at each (max len, batch) the
torch reference's time, then the `--top` fastest configs with their largest absolute difference from the reference
(device ms, `bench_kernels.time_ms`). Configs whose fp32 accumulator would need more than 128 registers a thread are
skipped; configs that fail to compile (shared memory) are listed last as failures.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels.decode_latent_attention as latent  # noqa: E402
from bench.bench_kernels import time_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=6)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_latent_attention_configs times GPU kernels and needs a CUDA GPU")
    dev, gen = torch.device("cuda"), torch.Generator("cuda").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device=dev, generator=gen).to(torch.bfloat16)

    configs = [triton.Config({"BLOCK_H": bh, "BLOCK_N": bn}, num_warps=w, num_stages=st)
               for bh, bn, w, st in itertools.product((16, 32, 64), (16, 32, 64, 128), (4, 8), (1, 2, 3))
               if bh * 512 // (w * 32) <= 128]
    kernel = latent._decode_latent_attention_kernel
    for max_len, batch in ((128, 256), (1024, 64), (1024, 256), (4096, 64)):
        cache, rope = rnd(257, max_len, 512), rnd(257, max_len, 64)
        slot = torch.randperm(256, device=dev, generator=gen)[:batch]
        pos = torch.randint(0, max_len, (batch,), device=dev, generator=gen)
        inputs = (rnd(batch, 128, 512), rnd(batch, 128, 64), cache, rope, slot, pos, max_len, 192 ** -0.5)
        want = latent.decode_latent_attention_reference(*inputs).float()
        rows = []
        for config in configs:
            kernel.configs, kernel.cache = [config], {}
            try:
                err = (latent.decode_latent_attention(*inputs).float() - want).abs().max().item()
                rows.append((time_ms(lambda: latent.decode_latent_attention(*inputs), 3, args.reps), str(config), err))
            except Exception as e:  # noqa: BLE001 (a config the GPU cannot run: listed, not fatal)
                rows.append((float("inf"), str(config), type(e).__name__))
        rows.sort(key=lambda row: row[0])
        reference = time_ms(lambda: latent.decode_latent_attention_reference(*inputs), 3, args.reps)
        print(f"max len {max_len}, batch {batch}: reference {reference:.3f} ms")
        for ms, config, err in rows[:args.top] + [r for r in rows if r[0] == float("inf")]:
            print(f"   {ms:.3f} ms  {config}  max abs diff {err}")


if __name__ == "__main__":
    main()
