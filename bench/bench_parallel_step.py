"""Training-step throughput and communication breakdown of one folded layout, on synthetic packed micro-batches.

    torchrun --standalone --nproc_per_node=8 bench/bench_parallel_step.py --config configs/qwen3_30b_a3b.yaml \
        model.num_layers=2 data.micro_batch_size=2 parallel.ep=8 [--warmup 3] [--steps 8] [--profile-steps 3] \
        [--json out.jsonl] [--balanced-routing] [--trace DIR]
    torchrun --standalone --nproc_per_node=2 bench/bench_parallel_step.py --config configs/tiny.yaml parallel.ep=2
    torchrun --standalone --nproc_per_node=2 bench/bench_parallel_step.py --config configs/qwen3_30b_a3b.yaml \
        model.num_layers=8 data.grad_accum=8 parallel.pp=2 [parallel.pp_virtual=2]   # plain vs interleaved 1F1B

The model, its sharding, memory policy and optimizer are built as in `services/trainer/train.py` (the folded path on
several ranks, the plain AdamW step on one); the dataloader service is replaced by random tokens packed into a few
documents per sequence, identical on the TP/CP/PP peers of a data-parallel rank and different across DP ranks. After
`--warmup` untimed and `--steps` timed steps, `--profile-steps` steps (0: none) run under torch.profiler, and their
figures are per step of that profiled window (its wall time, profiler overhead included, is the "% of step"
denominator):

- on CUDA, from each rank's device kernels (bench/trace_summary.py): per collective (NCCL kernel name) the summed kernel
  time and the EXPOSED time, when that collective's kernels run and no compute/copy kernel does (waits for slower
  peers included), plus the exposed time of all NCCL kernels together; and the step-time breakdown: device time per
  kernel category (expert GEMM, dense GEMM, attention, optimizer, memcpy/memset, elementwise+other; each the union of
  its kernels, so categories on different streams overlap), device busy (union of all kernels) and idle (step − busy).
- on CPU/gloo, the host-side time of gloo's collectives (its worker threads' record_functions; gloo has no
  reduce-scatter here: the trainer all-reduces instead). There are no device kernels, so exposed time and the
  breakdown are n/a.

Rank 0 prints one table (and one JSON line to `--json`); profiled figures are the mean over ranks, the median step is
the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.trace_summary import COMM_CATEGORIES, COMPUTE_CATEGORIES, summarize  # noqa: E402
from services.common.config import load_config  # noqa: E402
from services.common.registry import Registry, redis_url  # noqa: E402
from services.trainer import checkpointing  # noqa: E402
from services.trainer.metrics import datasheet_peak, flops_per_token  # noqa: E402
from services.trainer.optim import build_adamw, clip_and_step, lr_at, set_lr  # noqa: E402
from services.trainer.parallel.expert_parallel import sync_expert_load  # noqa: E402
from services.trainer.parallel.groups import init_groups  # noqa: E402
from services.trainer.parallel.parallelize import build_optimizer, forward_backward_parallel  # noqa: E402
from services.trainer.step import count_loss_tokens, forward_backward  # noqa: E402
from services.trainer.train import (advance_router_bias, apply_model_memory_policy, build_model,  # noqa: E402
                                    init_runtime, seed_everything)

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


def balanced_ids(router, args: tuple) -> None:
    """Router forward pre-hook of `--balanced-routing`: replay ids that give every expert the same load (the router
    then runs its torch path: its fused kernel does not take replayed ids)."""
    T, k, E = args[0].shape[0], router.top_k, router.num_experts
    t = torch.arange(T, device=args[0].device)
    router.replay_ids = (t[:, None] * k + torch.arange(k, device=t.device)) % E


def gloo_comm(events) -> dict[str, float]:
    """CPU/gloo: µs per collective of gloo's worker-thread record_functions, summed over the profiled steps."""
    sums = dict.fromkeys(COMM_CATEGORIES, 0.0)
    for e in events:
        name = e.name.lower().replace("_", "")
        if name.startswith("gloo:"):
            sums[next((c for c, keys in GLOO_KEYS.items() if any(k in name for k in keys)), "other")] += \
                e.time_range.elapsed_us()
    return sums


def profile_summary(events, cuda: bool) -> dict[str, dict[str, float]]:
    """µs over the profiled steps, grouped as in trace_summary.summarize on CUDA; only "comm" (gloo, host) on CPU."""
    if not cuda:
        return {"comm": gloo_comm(events)}
    return summarize((e.name, e.time_range.start, e.time_range.end) for e in events
                     if e.device_type == torch.autograd.DeviceType.CUDA)


def mean_over_ranks(figures: dict[str, dict[str, float]], scale: float, device: torch.device,
                    parallel: bool) -> dict[str, dict[str, float]]:
    """Every figure averaged over the ranks and multiplied by `scale`; every rank passes the same keys."""
    keys = [(g, k) for g, group in figures.items() for k in group]
    t = torch.tensor([figures[g][k] for g, k in keys], dtype=torch.float64, device=device)
    if parallel:
        dist.all_reduce(t)
    t = t * scale / (dist.get_world_size() if parallel else 1)
    out: dict[str, dict[str, float]] = {g: {} for g in figures}
    for (g, k), v in zip(keys, t.tolist()):
        out[g][k] = v
    return out


def profile_rows(prof: dict[str, dict[str, float]], cuda: bool) -> list[tuple[str, str]]:
    """The printed table's profile section: comm per collective (and exposed), then the step-time breakdown."""
    step = prof["step"]["wall"]

    def fig(ms: float) -> str:
        return f"{ms:9.2f} ms/step {100 * ms / step:5.1f}%" if step else f"{ms:9.2f} ms/step"

    comm = prof["comm"]
    rows = [(f"  {c}", fig(ms) + (f"   exposed {fig(prof['exposed'][c])}" if cuda else "   exposed n/a"))
            for c, ms in comm.items()]
    rows.append(("  comm total", fig(sum(comm.values())) + (
        f"   exposed {fig(prof['exposed']['total'])}  (all NCCL kernels, overlaps counted once)" if cuda
        else "   exposed n/a (CPU: no device kernels to overlap)")))
    if not cuda:
        return rows + [("step breakdown", "n/a (CPU: no device kernels)")]
    rows.append(("step breakdown", "device time per kernel category (union of its kernels; streams overlap)"))
    rows += [(f"  {c}", fig(ms)) for c, ms in prof["compute"].items()]
    rows += [("  comm (NCCL)", fig(prof["device"]["comm"])), ("  device busy", fig(prof["device"]["busy"])),
             ("  device idle", fig(max(0.0, step - prof["device"]["busy"])))]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--json", default=None, help="append the figures as one JSON line to this file")
    ap.add_argument("--save-every", type=int, default=0,
                    help="save a checkpoint every N timed steps through the trainer's path, to the writer registered "
                         "for run.name in REDIS_URL's Redis (0: no saves)")
    ap.add_argument("--balanced-routing", action="store_true",
                    help="every MoE layer sends token t to experts (t*k + j) mod E, j < k (routing replay): the even "
                         "load a trained router approaches; a model fresh from init routes most tokens to a few "
                         "experts, and EP ranks then wait for the busiest")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="write the profiled steps as DIR/trace_rank<r>.json (Chrome trace, for bench/trace_gaps.py) "
                         "and DIR/host_ops_rank<r>.txt (operators by host time)")
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    rt = init_runtime(cfg)  # process group (nccl on CUDA, gloo on CPU) and the world-size validation
    seed_everything(cfg.run.seed)
    groups = init_groups(cfg, rt.world_size, rt.rank)
    parallel = rt.world_size > 1
    t_build = time.perf_counter()
    model = build_model(cfg, rt, groups)  # this rank's slices only, as the trainer builds them
    build_s = time.perf_counter() - t_build
    apply_model_memory_policy(model, cfg)
    if args.balanced_routing:
        for layer in model.moe_layers():
            layer.router.register_forward_pre_hook(balanced_ids)
    optimizer = build_optimizer(model, cfg, groups) if parallel else build_adamw(model, cfg.optimizer)
    cuda = rt.device.type == "cuda"
    total = args.warmup + args.steps + args.profile_steps
    batches = [synthetic_step(cfg, groups.dp.rank, s) for s in range(min(total, 4))]

    losses: list[torch.Tensor] = []  # per step: mean token loss over all ranks (compare layouts on the same data)
    saver = connect_saver(cfg, rt, model, optimizer, groups if parallel else None) if args.save_every else None

    def step(i: int) -> None:
        mbs, lr = batches[i % len(batches)], lr_at(i, cfg.optimizer, total)
        if parallel:
            optimizer.zero_grad()
            loss, tokens = forward_backward_parallel(model, mbs, groups, cfg, rt.device, rt.autocast_dtype, optimizer)
            losses.append(loss / tokens.clamp_min(1))
            optimizer.step(lr)
            sync_expert_load(model, groups)
        else:
            set_lr(optimizer, lr)
            optimizer.zero_grad(set_to_none=True)
            tokens = count_loss_tokens(mbs)
            losses.append(forward_backward(model, mbs, tokens, rt.device, rt.autocast_dtype) / max(tokens, 1))
            clip_and_step(optimizer, model.parameters(), cfg.optimizer.clip_grad)
        advance_router_bias(model, cfg)
        if cuda and saver is not None:  # the training stream only: a save's copies run on a side stream meanwhile
            torch.cuda.current_stream(rt.device).synchronize()
        elif cuda:
            torch.cuda.synchronize(rt.device)

    for i in range(args.warmup):
        step(i)
    if cuda:
        torch.cuda.reset_peak_memory_stats(rt.device)
    times, saves = [], []  # saves: [index in times of the step before the save, seconds save() held the loop]
    for i in range(args.warmup, args.warmup + args.steps):
        t0 = time.perf_counter()
        step(i)
        took = time.perf_counter() - t0
        if saver is not None and (i + 1 - args.warmup) % args.save_every == 0:
            saves.append([len(times), checkpointing.save(saver, cfg, model, optimizer, NO_DATA, i + 1,
                                                         groups if parallel else None)])
        times.append(took)
    if saver is not None:
        saver.wait()
        saver.close()
    prof_ms = None  # `--profile-steps 0`: no profile, no profile figures
    if args.profile_steps:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for i in range(args.warmup + args.steps, total):
                step(i)
            wall_us = (time.perf_counter() - t0) * 1e6
        if args.trace:
            write_trace(prof, Path(args.trace), rt.rank)
        figures = profile_summary(prof.events(), cuda)
        figures["step"] = {"wall": wall_us}
        # ms per profiled step, mean over ranks (each rank's exposed comm and idle time are its own).
        prof_ms = mean_over_ranks(figures, 1e-3 / args.profile_steps, rt.device, parallel)

    # The step is as slow as its slowest rank: max over ranks per step, then the median.
    step_t = torch.tensor(times, dtype=torch.float64, device=rt.device)
    mem = torch.tensor([torch.cuda.max_memory_allocated(rt.device) / 2**30 if cuda else 0.0], device=rt.device)
    if parallel:
        dist.all_reduce(step_t, op=dist.ReduceOp.MAX)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    step_ms = statistics.median(step_t.tolist()) * 1000
    save_figures = save_result(saves, step_t.tolist(), rt.device, parallel) if saves else None
    lay = groups.layout
    tokens_per_step = cfg.data.micro_batch_size * cfg.data.seq_len * cfg.data.grad_accum * groups.dp.size
    tps = tokens_per_step / (step_ms / 1000)
    peak = cfg.run.peak_tflops or datasheet_peak(rt.device)
    flops_tok = flops_per_token(cfg.model, cfg.data.seq_len)
    result = {
        "layout": {**{k: getattr(lay, k) for k in ("tp", "cp", "ep", "etp", "dp", "edp", "pp")},
                   "pp_virtual": cfg.parallel.pp_virtual}, "world": rt.world_size,
        "device": torch.cuda.get_device_name(rt.device) if cuda else "cpu", "tokens_per_step": tokens_per_step,
        "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / rt.world_size,
        "mfu": tps * flops_tok / 1e12 / rt.world_size / peak if peak else None, "peak_tflops": peak,
        "median_step_ms": step_ms, "losses": [round(float(v), 5) for v in losses],
        "peak_mem_gib": mem.item() if cuda else None, "model_build_s": build_s,
    }
    if prof_ms is not None:
        result |= profile_result(prof_ms, cuda)
    if save_figures is not None:
        result["saves"] = save_figures
    if rt.rank == 0:
        rows = [("layout", " ".join(f"{k}{v}" for k, v in result["layout"].items()) + f"  (world {rt.world_size})"),
                ("device", f"{result['device']} | torch {torch.__version__}"),
                ("tokens/s (all ranks)", f"{tps:,.0f}  ({tokens_per_step:,} tokens/step)"),
                ("tokens/s per GPU", f"{tps / rt.world_size:,.0f}"),
                ("MFU", f"{100 * result['mfu']:.1f}% of {peak:.0f} TFLOP/s" if peak else "n/a (no datasheet peak)"),
                ("median step", f"{step_ms:.1f} ms  ({args.steps} timed steps)"),
                ("loss", f"{float(losses[0]):.4f} -> {float(losses[-1]):.4f}  (steps 1 -> {len(losses)}, "
                         f"{len(batches)} batches cycled)"),
                ("peak memory", f"{mem.item():.2f} GiB" if cuda else "n/a (CPU)"),
                ("model build", f"{build_s:.1f} s on rank 0 (its own slices, initialised)")]
        if save_figures is not None:
            f = save_figures
            rows.append(("checkpoint saves", f"{f['count']} every {args.save_every} steps: save() held the loop "
                         f"{f['call_ms']:.1f} ms (median, slowest rank); the step after a save took "
                         f"{f['after_ms']:.1f} ms against {f['other_ms']:.1f} ms for the others (median): stall "
                         f"{f['stall_ms']:.1f} ms"))
        if prof_ms is None:
            rows.append(("profile", "off (--profile-steps 0)"))
        else:
            rows += [("profiled step", f"{result['profiled_step_ms']:.1f} ms wall, mean over ranks and "
                      f"{args.profile_steps} step(s) under torch.profiler (its overhead included); the % below are "
                      "of it"),
                     ("comm source", result["comm_source"]),
                     *profile_rows(prof_ms, cuda)]
        print("\n".join(f"{k:<22}{v}" for k, v in rows), flush=True)
        if args.json:
            with open(args.json, "a") as fh:
                fh.write(json.dumps(result) + "\n")
    if parallel:
        dist.destroy_process_group()


def write_trace(prof, out: Path, rank: int) -> None:
    """`--trace`: the profiled steps' Chrome trace and a table of operators by host (self CPU) time."""
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / f"trace_rank{rank}.json"))
    (out / f"host_ops_rank{rank}.txt").write_text(
        prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60))


NO_DATA = SimpleNamespace(state=lambda: {"position": 0})  # synthetic batches: no dataloader position to save


def connect_saver(cfg, rt, model, optimizer, groups):
    """A Snapshotter to the checkpoint writer registered for `run.name`, its host buffers prepared, as the trainer
    does at start-up."""
    registry = Registry(redis_url(), cfg.run.name)
    registry.wait_for("checkpointer", timeout=60)
    saver = checkpointing.connect(registry, cfg, rt.rank, rt.world_size)
    checkpointing.attach(saver, model, optimizer, rt.rank, groups)
    saver._join_prepare()  # pinned buffers ready before the timed steps, as bench_checkpoint.py waits
    return saver


def save_result(saves: list[list], step_s: list[float], device: torch.device, parallel: bool) -> dict:
    """The saves' cost: the time save() held the loop (median over saves, slowest rank) plus what the step after
    each save took over the median of the other steps (the fence holds the next optimizer step until the copies
    land)."""
    calls = torch.tensor([held for _, held in saves], dtype=torch.float64, device=device)
    if parallel:
        dist.all_reduce(calls, op=dist.ReduceOp.MAX)
    after = [step_s[i + 1] for i, _ in saves if i + 1 < len(step_s)]
    others = [t for j, t in enumerate(step_s) if j - 1 not in {i for i, _ in saves}]
    call_ms = statistics.median(calls.tolist()) * 1000
    after_ms = statistics.median(after) * 1000 if after else float("nan")
    other_ms = statistics.median(others) * 1000
    return {"count": len(saves), "call_ms": call_ms, "after_ms": after_ms, "other_ms": other_ms,
            "stall_ms": call_ms + max(0.0, after_ms - other_ms)}


def profile_result(prof_ms: dict[str, dict[str, float]], cuda: bool) -> dict:
    """The JSON record's profile figures (ms per profiled step, mean over ranks)."""
    busy = prof_ms["device"]["busy"] if cuda else None
    return {
        "profiled_step_ms": prof_ms["step"]["wall"],
        "comm_source": ("nccl kernels, device time (all_to_all holds every SendRecv kernel: PP and CP-ring p2p too); "
                        "exposed = while no compute/copy kernel runs on the rank"
                        if cuda else "gloo ops, HOST-SIDE time in gloo threads, waits for peers included (no CUDA "
                        "kernels on CPU; other = PP/CP send/recv, post to completion)"),
        "comm_ms_per_step": prof_ms["comm"], "comm_total_ms_per_step": sum(prof_ms["comm"].values()),
        "comm_exposed_ms_per_step": {c: prof_ms["exposed"][c] for c in COMM_CATEGORIES} if cuda else None,
        "comm_exposed_total_ms_per_step": prof_ms["exposed"]["total"] if cuda else None,
        "compute_ms_per_step": {c: prof_ms["compute"][c] for c in COMPUTE_CATEGORIES} if cuda else None,
        "device_comm_ms_per_step": prof_ms["device"]["comm"] if cuda else None,
        "device_compute_ms_per_step": prof_ms["device"]["compute"] if cuda else None,
        "device_busy_ms_per_step": busy,
        "device_idle_ms_per_step": max(0.0, prof_ms["step"]["wall"] - busy) if cuda else None,
    }


if __name__ == "__main__":
    main()
