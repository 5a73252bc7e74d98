"""Probe: the EP token exchange with split sizes read on the host (NCCL, as AllToAllDispatcher does) against
torch's NVSHMEM all-to-all whose split sizes stay on the device (`torch.ops.symm_mem.all_to_all_vdev`; its 2-D
variant, which would also group the rows by local expert, takes at most 32 experts per rank in torch 2.11).

    torchrun --standalone --nproc_per_node=2 bench/probe_ep_device_splits.py [--tokens 8192] [--reps 20]

Each iteration runs a stand-in for the layer's compute (a bf16 GEMM of `--compute` ms) and then one dispatch of
tokens x top-k rows, routed uniformly at random over the experts, to the ranks that hold them (rows grouped by source
rank on arrival, as both ways deliver them). Timed by wall clock over `--reps` iterations queued back to back (no synchronisation but the exchange's own):
the host read of the split sizes drains the GPU's queue, so its cost is the GPU idling while the host catches up.
Prints whether NVSHMEM is available, the ms per iteration of the compute alone, of compute + NCCL with the split
sizes known ahead (the floor: the transfer alone), of the way the dispatcher does it, and of NVSHMEM, and whether
NVSHMEM received the same rows. Symmetric tensors are allocated on `cuda:<rank>` explicitly: a bare "cuda" device
made torch 2.11's NVSHMEM op fail with "Detected use of TeamManager on multiple devices".
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem


def compute_standin(ms: float) -> callable:
    n = 4096
    a = torch.randn(n, n, device=torch.cuda.current_device(), dtype=torch.bfloat16)
    a @ a  # cuBLAS's first call: set-up, not counted
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    per = (time.perf_counter() - t) / 10 * 1e3
    reps = max(1, round(ms / per))
    return lambda: [a @ a for _ in range(reps)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--compute", type=float, default=2.0, help="ms of GEMM ahead of each exchange")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)

    E, El, h = args.experts, args.experts // world, args.hidden
    rows = args.tokens * args.topk
    gen = torch.Generator(device=dev).manual_seed(rank)
    expert = torch.randint(0, E, (rows,), device=dev, generator=gen).sort().values
    counts = torch.bincount(expert, minlength=E)  # rows by global expert = by destination rank, then local expert
    x = torch.randn(rows, h, device=dev, dtype=torch.bfloat16, generator=gen)
    compute = compute_standin(args.compute)

    def nccl_way() -> torch.Tensor:
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts)
        send_host, recv_host = counts.view(world, El).cpu(), recv_counts.view(world, El).cpu()  # the host sync
        send, recv = send_host.sum(1).tolist(), recv_host.sum(1).tolist()
        out = x.new_empty(sum(recv), h)
        dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send)
        return out

    rank0 = lambda *a: print(*a, flush=True) if rank == 0 else None  # noqa: E731
    available = symm_mem.is_nvshmem_available()
    rank0(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | world {world} | NVSHMEM available: "
          f"{available} | rows {rows} x {h} bf16, {E} experts")

    def timed(fn) -> float:
        for _ in range(3):
            compute(), fn()
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(args.reps):
            compute()
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / args.reps * 1e3

    t_compute = timed(lambda: None)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)
    send, recv = counts.view(world, El).sum(1).tolist(), recv_counts.view(world, El).sum(1).tolist()
    out_known = x.new_empty(sum(recv), h)
    t_known = timed(lambda: dist.all_to_all_single(out_known, x, output_split_sizes=recv, input_split_sizes=send))
    rank0(f"compute alone {t_compute:.3f} ms | + NCCL rows, splits known ahead (no sync) {t_known:.3f} ms")
    t_nccl = timed(nccl_way)
    rank0(f"compute alone {t_compute:.3f} ms | + NCCL dispatch, splits read on the host {t_nccl:.3f} ms")
    if not available:
        dist.destroy_process_group()
        return
    symm_mem.set_backend("NVSHMEM")
    group = dist.group.WORLD.group_name
    inp = symm_mem.empty(rows, h, dtype=torch.bfloat16, device=dev)
    out = symm_mem.empty(rows * world, h, dtype=torch.bfloat16, device=dev)  # worst case: all rows to one rank
    in_splits = symm_mem.empty(world, dtype=torch.int64, device=dev)
    out_splits_offsets = symm_mem.empty((2, world), dtype=torch.int64, device=dev)
    for t in (inp, out, in_splits, out_splits_offsets):
        symm_mem.rendezvous(t, group=group)
    dist.barrier()

    def nvshmem_way() -> torch.Tensor:
        inp.copy_(x)
        in_splits.copy_(counts.view(world, El).sum(1))
        torch.ops.symm_mem.all_to_all_vdev(inp, out, in_splits, out_splits_offsets, group)
        return out

    t_nv = timed(nvshmem_way)
    ref = nccl_way()
    got = nvshmem_way()
    same = torch.equal(got[:ref.shape[0]], ref)
    rank0(f"+ NVSHMEM all_to_all_vdev, splits on the device {t_nv:.3f} ms | same rows: {same}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
