"""Does a memory-bound pass on a second CUDA stream hide behind compute-bound GEMMs on the first?

The question behind it: the optimizer's AdamW pass (~21 ms of a 90 ms step at the 4-layer Qwen3-30B-A3B shape, at
memory bandwidth) and the gradient norm could run beside the next step's forward GEMMs, layer by layer, if the device
overlapped them. This measures it directly: bf16 GEMMs alone, the AdamW kernel (kernels/adamw.py: bf16 parameters,
fp32 masters, bf16 moments) or the gradient norm alone, then each on a side stream while the GEMMs run.

    python3 bench/bench_stream_overlap.py      (CUDA only)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.adamw import adamw_step  # noqa: E402

N_PARAMS = 400_000_000


def timed(fn) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    dev = torch.device("cuda")
    a = torch.randn(8192, 2048, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2048, 16384, device=dev, dtype=torch.bfloat16)
    master = torch.randn(N_PARAMS, device=dev)
    param, grad = master.to(torch.bfloat16), torch.randn(N_PARAMS, device=dev, dtype=torch.bfloat16)
    m, v = (torch.zeros(N_PARAMS, device=dev, dtype=torch.bfloat16) for _ in range(2))
    side = torch.cuda.Stream()

    def gemms():
        for _ in range(40):
            a @ w

    def adamw():
        for i in range(4):
            adamw_step(master, grad, m, v, param, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                       step=i + 1)

    def norm():
        for _ in range(4):
            torch._foreach_norm([grad], 2, dtype=torch.float32)

    def beside_gemms(fn):
        def run():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            gemms()
            torch.cuda.current_stream().wait_stream(side)
        return run

    g = timed(gemms)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | 40 GEMMs 8192x2048x16384 bf16: {g:.2f} ms")
    print(f"{'side-stream pass':<34}{'alone ms':>10}{'with GEMMs ms':>15}{'sum ms':>9}{'hidden':>8}")
    for name, fn in (("AdamW, 4 x 400M parameters", adamw), ("grad norm, 4 x 400M bf16", norm)):
        alone, both = timed(fn), timed(beside_gemms(fn))
        print(f"{name:<34}{alone:>10.2f}{both:>15.2f}{g + alone:>9.2f}{(g + alone - both) / alone:>8.0%}")


if __name__ == "__main__":
    main()
