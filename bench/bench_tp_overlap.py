"""Tensor-parallel region collectives with and without compute overlap, on the GPUs of one host.

    torchrun --standalone --nproc_per_node=2 bench/bench_tp_overlap.py [--tokens 8192] [--hidden 2048]
        [--heads 32] [--kv-heads 4] [--head-dim 128] [--reps 30]

A sequence-parallel attention region (services/trainer/parallel/tensor_parallel.py) enters with an all-gather of the
rank's tokens followed by the q/k/v projections, and leaves with the output projection followed by a reduce-scatter.
This times both, each way, as the trainer runs them today (the collective, then the GEMM) and through torch's
micro-pipelined `symm_mem.fused_all_gather_matmul` / `fused_matmul_reduce_scatter` (the collective split per peer and
overlapped with the GEMM on that peer's rows), at Qwen3-30B-A3B's attention shapes by default. Device milliseconds,
median over `--reps`; every call is queued behind a GPU sleep so the host's launch time is not counted.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_kernels import time_ms as bench_time_ms  # noqa: E402


def time_ms(fn, reps: int) -> float:
    """The slower rank's median device ms of `fn` (`bench_kernels.time_ms`, the ranks aligned by a barrier)."""
    t = torch.tensor(bench_time_ms(fn, 3, reps, before=dist.barrier), device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the micro-batch (all TP ranks together)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    group = dist.group.WORLD
    name = group.group_name
    import torch.distributed._symmetric_memory as symm_mem
    with warnings.catch_warnings():  # deprecated (no longer needed) on newer torch, required on older
        warnings.simplefilter("ignore")
        symm_mem.enable_symm_mem_for_group(name)

    g = torch.Generator(device="cuda").manual_seed(rank)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    T, h, d = args.tokens, args.hidden, args.head_dim
    qkv_out = (args.heads + 2 * args.kv_heads) * d // n  # this rank's q, k and v columns
    attn_out = args.heads * d // n
    x_shard = torch.randn(T // n, h, generator=g, **bf16)
    w_qkv = torch.randn(h, qkv_out, generator=g, **bf16) / h ** 0.5  # [in, out]: the GEMM's B operand
    a = torch.randn(T, attn_out, generator=g, **bf16)
    w_o = torch.randn(attn_out, h, generator=g, **bf16) / attn_out ** 0.5

    def gather(t):
        out = t.new_empty(n * t.shape[0], *t.shape[1:])
        dist.all_gather_into_tensor(out, t, group=group)
        return out

    def scatter(t):
        out = t.new_empty(t.shape[0] // n, *t.shape[1:])
        dist.reduce_scatter_tensor(out, t, group=group)
        return out

    full = gather(x_shard)
    rows = {
        "entry: all-gather alone": lambda: gather(x_shard),
        "entry: GEMM alone": lambda: full @ w_qkv,
        "entry: all-gather, then GEMM (now)": lambda: gather(x_shard) @ w_qkv,
        "entry: fused_all_gather_matmul": lambda: torch.ops.symm_mem.fused_all_gather_matmul(
            x_shard, [w_qkv], 0, name),
        "exit: reduce-scatter alone": lambda: scatter(full),
        "exit: GEMM alone": lambda: a @ w_o,
        "exit: GEMM, then reduce-scatter (now)": lambda: scatter(a @ w_o),
        "exit: fused_matmul_reduce_scatter": lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(
            a, w_o, "sum", 0, name),
    }
    # The fused ops must give what the plain ones give before their times mean anything.
    ref_in, fused_in = gather(x_shard) @ w_qkv, torch.ops.symm_mem.fused_all_gather_matmul(x_shard, [w_qkv], 0, name)[1][0]
    ref_out = scatter(a @ w_o)
    fused_out = torch.ops.symm_mem.fused_matmul_reduce_scatter(a, w_o, "sum", 0, name)
    err_in = ((fused_in.float() - ref_in.float()).abs().max() / ref_in.float().abs().max()).item()
    err_out = ((fused_out.float() - ref_out.float()).abs().max() / ref_out.float().abs().max()).item()
    times = {k: time_ms(fn, args.reps) for k, fn in rows.items()}
    if rank == 0:
        flops_in, flops_out = 2 * T * h * qkv_out, 2 * T * attn_out * h
        print(f"{torch.cuda.get_device_name()} x{n} | torch {torch.__version__} | T={T} h={h} "
              f"qkv cols/rank={qkv_out} o rows/rank={attn_out} | max rel. error fused vs plain: "
              f"entry {err_in:.2e}, exit {err_out:.2e}")
        for k, ms in times.items():
            fl = flops_in if k.startswith("entry") else flops_out
            rate = f"{fl / ms / 1e9:8.0f} TFLOP/s" if "GEMM" in k or "fused" in k else ""
            print(f"  {k:42s} {ms:8.3f} ms  {rate}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
