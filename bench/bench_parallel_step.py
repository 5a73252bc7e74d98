"""Training-step throughput and communication breakdown of one folded layout, on synthetic packed micro-batches.

    torchrun --standalone --nproc_per_node=8 bench/bench_parallel_step.py --config configs/qwen3_30b_a3b.yaml \
        model.num_layers=2 data.micro_batch_size=2 parallel.ep=8 [--warmup 3] [--steps 8] [--profile-steps 3] \
        [--json out.jsonl]
    torchrun --standalone --nproc_per_node=2 bench/bench_parallel_step.py --config configs/tiny.yaml parallel.ep=2

The model, its sharding, memory policy and optimizer are built as in `services/trainer/train.py` (the folded path on
several ranks, the plain AdamW step on one); the dataloader service is replaced by random tokens packed into a few
documents per sequence, identical on the TP/CP/PP peers of a data-parallel rank and different across DP ranks. After
`--warmup` untimed and `--steps` timed steps, `--profile-steps` steps run under torch.profiler: on CUDA the device time
of NCCL kernels is summed by collective (kernel name), on CPU/gloo the host-side time of gloo's collectives (its
worker threads' record_functions; gloo has no reduce-scatter here: the trainer all-reduces instead).
Rank 0 prints one table (and one JSON line to `--json`); comm figures are the mean over ranks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.common.config import load_config  # noqa: E402
from services.trainer.metrics import datasheet_peak, flops_per_token  # noqa: E402
from services.trainer.model.recompute import apply_memory_policy  # noqa: E402
from services.trainer.model.transformer import MoETransformer  # noqa: E402
from services.trainer.optim import build_adamw, lr_at, set_lr  # noqa: E402
from services.trainer.parallel.expert_parallel import sync_expert_load  # noqa: E402
from services.trainer.parallel.groups import init_groups  # noqa: E402
from services.trainer.parallel.parallelize import build_optimizer, forward_backward_parallel, parallelize  # noqa: E402
from services.trainer.step import count_loss_tokens, forward_backward  # noqa: E402
from services.trainer.train import init_runtime, seed_everything, update_router_bias  # noqa: E402

CATEGORIES = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce", "other")
# CUDA: NCCL kernel names (ncclDevKernel_AllGather_RING_LL, ncclKernel_AllReduce_..., ncclDevKernel_SendRecv).
# all_to_all_single runs as SendRecv kernels, and so do the pipeline's and CP ring's isend/irecv.
NCCL_KEYS = {"all_to_all": ("alltoall", "sendrecv"), "all_gather": ("allgather",),
             "reduce_scatter": ("reducescatter",), "all_reduce": ("allreduce",)}
# CPU/gloo: gloo's record_functions in its worker threads (gloo:all_to_all, gloo:all_gather, gloo:all_reduce, gloo:send,
# ...): the collective from start to end, waiting for peers included. The c10d::* ops on the main thread only enqueue.
# Send/recv (PP, CP ring) fall under "other", timed from post to completion: they overlap compute and can exceed a step.
GLOO_KEYS = {"all_to_all": ("alltoall",), "all_gather": ("allgather",),
             "reduce_scatter": ("reducescatter",), "all_reduce": ("allreduce",)}


def synthetic_step(cfg, dp_rank: int, step: int) -> list[dict[str, torch.Tensor]]:
    """`data.grad_accum` micro-batches in the DataClient's format: tokens, labels, position_ids, cu_seqlens, cp_size.
    Seeded by (seed, dp rank, step), so the peers of one DP rank build the same ones."""
    gen = torch.Generator().manual_seed(cfg.run.seed * 1_000_003 + dp_rank * 10_007 + step)
    S, mbs, out = cfg.data.seq_len, cfg.data.micro_batch_size, []
    for _ in range(cfg.data.grad_accum):
        tokens = torch.randint(0, cfg.model.vocab_size, (S * mbs,), generator=gen)
        labels, pos, cu = torch.full_like(tokens, -100), torch.empty_like(tokens), [0]
        for b in range(mbs):  # 1-4 documents per sequence, cut at random points
            cuts = torch.randperm(S - 1, generator=gen)[:int(torch.randint(0, 4, (1,), generator=gen))] + 1
            for a, e in zip([0, *sorted(cuts.tolist())], [*sorted(cuts.tolist()), S]):
                a, e = b * S + a, b * S + e
                pos[a:e] = torch.arange(e - a)
                labels[a:e - 1] = tokens[a + 1:e]  # the last token of a document predicts nothing
                cu.append(e)
        out.append({"tokens": tokens, "labels": labels, "position_ids": pos,
                    "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
                    "cp_size": torch.tensor(cfg.parallel.cp, dtype=torch.int64)})
    return out


def comm_breakdown(prof, cuda: bool) -> tuple[dict[str, float], float]:
    """(µs per category summed over the profiled steps, device busy µs (union of kernel intervals; 0 on CPU))."""
    sums = dict.fromkeys(CATEGORIES, 0.0)
    spans = []
    for e in prof.events():
        name = e.name.lower().replace("_", "")
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            spans.append((e.time_range.start, e.time_range.end))
        if (cuda and e.device_type == torch.autograd.DeviceType.CUDA and "nccl" in name) or (
                not cuda and name.startswith("gloo:")):
            cat = next((c for c, keys in (NCCL_KEYS if cuda else GLOO_KEYS).items() if any(k in name for k in keys)),
                       "other")
            sums[cat] += e.time_range.elapsed_us()
    busy, end = 0.0, float("-inf")
    for s, t in sorted(spans):
        busy += max(0.0, t - max(s, end))
        end = max(end, t)
    return sums, busy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--json", default=None, help="append the figures as one JSON line to this file")
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    rt = init_runtime(cfg)  # process group (nccl on CUDA, gloo on CPU) and the world-size validation
    seed_everything(cfg.run.seed)
    groups = init_groups(cfg, rt.world_size, rt.rank)
    parallel = rt.world_size > 1
    model = MoETransformer(cfg.model)
    model.init_weights(cfg.run.seed)
    if parallel:
        parallelize(model, cfg, groups)
    apply_memory_policy(model, cfg.model.recompute, cfg.model.offload, cfg.model.recompute_layers,
                        cfg.model.offload_layers)
    model.to(rt.device)
    optimizer = build_optimizer(model, cfg, groups) if parallel else build_adamw(model, cfg.optimizer)
    cuda = rt.device.type == "cuda"
    total = args.warmup + args.steps + args.profile_steps
    batches = [synthetic_step(cfg, groups.dp.rank, s) for s in range(min(total, 4))]

    def step(i: int) -> None:
        mbs, lr = batches[i % len(batches)], lr_at(i, cfg.optimizer, total)
        if parallel:
            optimizer.zero_grad()
            forward_backward_parallel(model, mbs, groups, cfg, rt.device, rt.autocast_dtype, optimizer)
            optimizer.step(lr)
            sync_expert_load(model, groups)
        else:
            set_lr(optimizer, lr)
            optimizer.zero_grad(set_to_none=True)
            forward_backward(model, mbs, count_loss_tokens(mbs), rt.device, rt.autocast_dtype)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.clip_grad)
            optimizer.step()
        update_router_bias(model, cfg, groups.dp.size)
        if cuda:
            torch.cuda.synchronize(rt.device)

    for i in range(args.warmup):
        step(i)
    if cuda:
        torch.cuda.reset_peak_memory_stats(rt.device)
    times = []
    for i in range(args.warmup, args.warmup + args.steps):
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for i in range(args.warmup + args.steps, total):
            step(i)
    sums, busy = comm_breakdown(prof, cuda) if args.profile_steps else (dict.fromkeys(CATEGORIES, 0.0), 0.0)

    # The step is as slow as its slowest rank: max over ranks per step, then the median; comm is the mean over ranks.
    step_t = torch.tensor(times, dtype=torch.float64, device=rt.device)
    comm = torch.tensor([sums[c] for c in CATEGORIES] + [busy], dtype=torch.float64, device=rt.device)
    mem = torch.tensor([torch.cuda.max_memory_allocated(rt.device) / 2**30 if cuda else 0.0], device=rt.device)
    if parallel:
        dist.all_reduce(step_t, op=dist.ReduceOp.MAX)
        dist.all_reduce(comm)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    comm = (comm / rt.world_size / max(args.profile_steps, 1) / 1000).tolist()  # ms per step, mean over ranks
    step_ms = statistics.median(step_t.tolist()) * 1000
    lay = groups.layout
    tokens_per_step = cfg.data.micro_batch_size * cfg.data.seq_len * cfg.data.grad_accum * groups.dp.size
    tps = tokens_per_step / (step_ms / 1000)
    peak = cfg.run.peak_tflops or datasheet_peak(rt.device)
    flops_tok = flops_per_token(cfg.model, cfg.data.seq_len)
    result = {
        "layout": {k: getattr(lay, k) for k in ("tp", "cp", "ep", "etp", "dp", "edp", "pp")}, "world": rt.world_size,
        "device": torch.cuda.get_device_name(rt.device) if cuda else "cpu", "tokens_per_step": tokens_per_step,
        "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / rt.world_size,
        "mfu": tps * flops_tok / 1e12 / rt.world_size / peak if peak else None, "peak_tflops": peak,
        "median_step_ms": step_ms, "peak_mem_gib": mem.item() if cuda else None,
        "comm_source": ("nccl kernels, device time (all_to_all holds every SendRecv kernel: PP and CP-ring p2p too)"
                        if cuda else "gloo ops, HOST-SIDE time in gloo threads, waits for peers included (no CUDA "
                        "kernels on CPU; other = PP/CP send/recv, post to completion)"),
        "comm_ms_per_step": dict(zip(CATEGORIES, comm[:-1])), "comm_total_ms_per_step": sum(comm[:-1]),
        "device_busy_ms_per_step": comm[-1] if cuda else None,
    }
    if rt.rank == 0:
        rows = [("layout", " ".join(f"{k}{v}" for k, v in result["layout"].items()) + f"  (world {rt.world_size})"),
                ("device", f"{result['device']} | torch {torch.__version__}"),
                ("tokens/s (all ranks)", f"{tps:,.0f}  ({tokens_per_step:,} tokens/step)"),
                ("tokens/s per GPU", f"{tps / rt.world_size:,.0f}"),
                ("MFU", f"{100 * result['mfu']:.1f}% of {peak:.0f} TFLOP/s" if peak else "n/a (no datasheet peak)"),
                ("median step", f"{step_ms:.1f} ms  ({args.steps} timed steps)"),
                ("peak memory", f"{mem.item():.2f} GiB" if cuda else "n/a (CPU)"),
                ("comm source", result["comm_source"] + f", mean over ranks, {args.profile_steps} profiled steps")]
        for c, ms in [*result["comm_ms_per_step"].items(), ("comm total", result["comm_total_ms_per_step"])] + (
                [("device busy", comm[-1])] if cuda else []):
            rows.append((f"  {c}", f"{ms:9.2f} ms/step  {100 * ms / step_ms:5.1f}% of step"))
        print("\n".join(f"{k:<22}{v}" for k, v in rows), flush=True)
        if args.json:
            with open(args.json, "a") as fh:
                fh.write(json.dumps(result) + "\n")
    if parallel:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
