"""Host launch overhead of a decoder block, eager against CUDA graphs (issue #8, sync-free MoE).

    python bench/bench_cuda_graphs.py [--config configs/qwen3_30b_a3b.yaml] [--tokens 512 2048 8192] [--iters 20]

One decoder block of the config (attention + MoE layer with its router, Triton permutation and `torch._grouped_mm`
experts, as the trainer runs it: fp32 parameters, bf16 autocast) on one packed micro-batch of `tokens` tokens in
four documents. Timed: forward + backward, eager and captured with `torch.cuda.make_graphed_callables` (one graph for
forward, one for backward). The dropless MoE layer never asks the device for a count (tests/test_moe_sync_free.py), so
the whole block captures; the difference is what launching its kernels one by one from Python costs. Each row also
checks the graphed block against eager on the same input (output and input gradient, relative L2).
ms/iter is the wall time of `--iters` back-to-back iterations divided by their number (launches overlap the GPU's work
as in training); "host ms" is the time Python takes to issue one eager iteration (measured with the GPU kept busy).
CUDA only.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.common.config import load_config  # noqa: E402
from services.trainer.model.attention import document_ids  # noqa: E402
from services.trainer.model.transformer import Block  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


class StaticBlock(nn.Module):
    """A block bound to one micro-batch's layout, so that its only input is the hidden states (what a graph replays)."""

    def __init__(self, block: Block, tokens: int, documents: int = 4):
        super().__init__()
        self.block = block
        bounds = torch.linspace(0, tokens, documents + 1).round().to(torch.int32)
        self.register_buffer("cu_seqlens", bounds)
        self.register_buffer("position_ids", torch.cat([torch.arange(int(b - a)) for a, b in zip(bounds, bounds[1:])]))
        self.register_buffer("segment_ids", document_ids(bounds, tokens))
        self.max_seqlen = int((bounds[1:] - bounds[:-1]).max())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, branch = self.block(x, self.position_ids, self.cu_seqlens, self.segment_ids, self.max_seqlen)
        return x + branch  # the block hands its last residual add to the next norm; alone, it is done here


def time_iters(fn, x: torch.Tensor, grad: torch.Tensor, iters: int) -> tuple[float, torch.Tensor, torch.Tensor]:
    """ms per forward + backward over `iters` back-to-back iterations; the last output and input gradient."""
    for _ in range(3):
        xi = x.detach().requires_grad_(True)
        fn(xi).backward(grad)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        xi = x.detach().requires_grad_(True)
        out = fn(xi)
        out.backward(grad)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / iters, out.detach(), xi.grad


def host_ms(fn, x: torch.Tensor, grad: torch.Tensor) -> float:
    """Python time to issue one forward + backward while the GPU is still busy with a long kernel (so no launch waits
    for the device): the pure launch cost."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    for _ in range(20):  # ~50 ms of queued GEMMs ahead of the block
        a @ a
    xi = x.detach().requires_grad_(True)
    t0 = time.perf_counter()
    fn(xi).backward(grad)
    t = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return t


def print_host_profile(fn, x: torch.Tensor, grad: torch.Tensor) -> None:
    from torch.profiler import ProfilerActivity, profile

    xi = x.detach().requires_grad_(True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(xi).backward(grad)
    torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "qwen3_30b_a3b.yaml"))
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--host-profile", action="store_true",
                    help="also print where the host time of one eager forward + backward goes (torch.profiler, CPU)")
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_cuda_graphs needs a CUDA device: CUDA graphs do not exist on the CPU")
    cfg = load_config(args.config, args.overrides).model
    layer_id = max(cfg.first_k_dense, 0)  # a MoE layer
    print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | block {layer_id} of {args.config} | "
          f"experts {cfg.num_experts} top-{cfg.top_k} | kernels {cfg.moe_kernels}")
    header = (f"{'tokens':>7} {'eager ms':>9} {'graph ms':>9} {'speed-up':>9} {'saved ms':>9} {'host ms':>8} "
              f"{'out err':>8} {'grad err':>8}")
    print(header)
    print("-" * len(header))
    for tokens in args.tokens:
        torch.manual_seed(0)
        block = Block(cfg, layer_id)
        with torch.no_grad():
            for name, p in block.named_parameters():
                p.copy_(torch.ones_like(p) if p.ndim == 1 else torch.randn_like(p) * 0.02)
        eager = StaticBlock(block, tokens).cuda()
        x = torch.randn(tokens, cfg.hidden_size, device="cuda")
        grad = torch.randn_like(x)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):  # graphs need the cast cache off
            eager_ms, eager_out, eager_grad = time_iters(eager, x, grad, args.iters)
            launch = host_ms(eager, x, grad)
            if args.host_profile and tokens == args.tokens[0]:
                print_host_profile(eager, x, grad)
            graphed = torch.cuda.make_graphed_callables(eager, (x.detach().requires_grad_(True),))
            graph_ms, graph_out, graph_grad = time_iters(graphed, x, grad, args.iters)
        print(f"{tokens:>7} {eager_ms:9.2f} {graph_ms:9.2f} {eager_ms / graph_ms:8.2f}x {eager_ms - graph_ms:9.2f} "
              f"{launch:8.2f} {rel(graph_out, eager_out):8.1e} {rel(graph_grad, eager_grad):8.1e}")
        del eager, graphed, block
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
