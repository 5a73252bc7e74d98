"""Peer benchmark: torchtitan 0.2.2 trains its own Qwen3 MoE model at the shape and batch of one of our configs, so a
GPU run can print foldmoe and torchtitan side by side (same tokens per step, same MFU formula, same table rows).

    bash bench/peer/stage_torchtitan.sh      # once, on a machine with internet: .peer/ (wheels + activate.sh)
    source .peer/activate.sh                 # on the GPU machine: torchtitan on PYTHONPATH, nothing else touched
    python bench/bench_peer_torchtitan.py --config configs/qwen3_30b_a3b.yaml model.num_layers=4 [--compile]
    torchrun --standalone --nproc_per_node=2 bench/bench_peer_torchtitan.py --config configs/qwen3_30b_a3b.yaml \
        model.num_layers=4 --ep 2 [--json out.jsonl]

The foldmoe side of the comparison: bench/bench_train_step.py (1 GPU) and, for `--ep 2`, bench/bench_parallel_step.py
under torchrun with `parallel.ep=2`, with the same config and overrides.

torchtitan is used through its own recipe, as its train.py does it: the model built on the meta device in
`training.dtype` (fp32) from the Qwen3 train spec (its "30B-A3B" flavor with our config's numbers written over it),
the spec's parallelize function (qwen3's parallelize_qwen3: EP over the FSDP dimension, FSDP2, per-block
torch.compile, activation checkpointing) driven by a JobConfig parsed by its ConfigManager, `init_weights`, the spec's
optimizer builder (torch AdamW, fused on CUDA) and loss, its `maybe_enable_amp` (autocast to bf16 on one GPU; with
FSDP, FSDP2's bf16 parameters and fp32 gradient reduction instead), and its EP-aware gradient-norm clipping. The data
is random token ids, one fixed batch per data-parallel rank (so the loss must fall: a sanity check), `data.seq_len`
tokens per sequence and `data.micro_batch_size` sequences per micro-batch, `data.grad_accum` micro-batches per step.

On CPU (for a check without a GPU) the experts run torchtitan's for-loop path (`use_grouped_mm=False`: CPU support
of torch._grouped_mm depends on the torch version; the loop runs on any), under torchrun the process group is gloo,
and `cpu_shims` and `gloo_sum_only` bridge four GPU assumptions of torchtitan's and FSDP2's (none is touched on CUDA).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.common.config import Config, load_config  # noqa: E402
from services.trainer.metrics import datasheet_peak, flops_per_token  # noqa: E402

FLAVOR = "30B-A3B"  # the torchtitan Qwen3 flavor we start from; every shape field is then taken from our config


def import_torchtitan():
    """torchtitan's Qwen3 train spec and the pieces of its training loop. Its HF-dataset module imports `datasets` at
    the top (which pulls pyarrow and pandas, ~60 MiB, not staged): when that is not installed an inert placeholder
    stands in; this benchmark never builds torchtitan's dataloader."""
    if importlib.util.find_spec("torchtitan") is None:
        raise SystemExit("torchtitan is not importable: run `bash bench/peer/stage_torchtitan.sh` where there is "
                         "internet, then `source .peer/activate.sh` before this benchmark")
    if importlib.util.find_spec("datasets") is None:
        placeholder = types.ModuleType("datasets")
        placeholder.__doc__ = "placeholder: torchtitan's HF dataloader is not used by bench_peer_torchtitan"
        placeholder.distributed = types.ModuleType("datasets.distributed")
        placeholder.Dataset = placeholder.load_dataset = placeholder.distributed.split_dataset_by_node = None
        sys.modules.update({"datasets": placeholder, "datasets.distributed": placeholder.distributed})
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.config import TORCH_DTYPE_MAP, ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.qwen3 import get_train_spec
    from torchtitan.tools import utils as titan_utils

    return types.SimpleNamespace(spec=get_train_spec(), dist_utils=dist_utils, ParallelDims=ParallelDims,
                                 ConfigManager=ConfigManager, dtype_map=TORCH_DTYPE_MAP, utils=titan_utils)


def cpu_shims() -> None:
    """Three things torchtitan assumes a GPU for, bridged for the CPU check only (never on CUDA): its meshes are built
    for the device type it detects, "cuda" when there is no accelerator; the EP dispatch builds its permutation indices
    with a Triton kernel (torchtitan's own CPU version of it, fill_indices_cpu, is used instead); and its router counts
    tokens per expert with torch.histc on int64 expert ids, which CUDA implements and CPU does not (the CPU count goes
    through fp32, exact below 2**24 tokens, and is returned as int64 like CUDA's)."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.models.moe.kernels as moe_kernels

    parallel_dims.device_type = "cpu"
    moe_kernels.fill_indices_wrapper = moe_kernels.fill_indices_cpu
    histc = torch.histc

    def histc_int_on_cpu(x, *args, **kwargs):
        if x.device.type == "cpu" and not x.is_floating_point():
            return histc(x.float(), *args, **kwargs).to(x.dtype)
        return histc(x, *args, **kwargs)

    torch.histc = histc_int_on_cpu


def gloo_sum_only(model: torch.nn.Module) -> None:
    """The CPU check's fourth bridge: FSDP2 reduce-scatters gradients with ReduceOp.AVG or PREMUL_SUM (torchtitan sets
    a divide factor for EP), which gloo lacks; with sum-only comms FSDP2 divides before/after a SUM instead."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


def job_config(tt, cfg: Config, args, world: int, cuda: bool):
    """torchtitan's JobConfig, parsed from command-line flags by its own ConfigManager (as `torchtitan/train.py`)."""
    o, d = cfg.optimizer, cfg.data
    flags = {
        "model.name": "qwen3", "model.flavor": FLAVOR,
        "training.seq_len": d.seq_len, "training.local_batch_size": d.micro_batch_size,
        "training.global_batch_size": d.micro_batch_size * d.grad_accum * world,  # dp_shard = world: grad_accum steps
        "training.dtype": args.dtype,  # float32: master weights, compute precision below; bfloat16: no fp32 copy
        "training.mixed_precision_param": "bfloat16" if cfg.run.dtype == "bf16" else "float32",
        "training.mixed_precision_reduce": "float32",
        "training.max_norm": o.clip_grad, "training.steps": args.warmup + args.steps,
        "parallelism.data_parallel_shard_degree": -1, "parallelism.expert_parallel_degree": args.ep,
        "activation_checkpoint.mode": args.ac,
        "optimizer.name": "AdamW", "optimizer.lr": o.lr, "optimizer.beta1": o.beta1, "optimizer.beta2": o.beta2,
        "optimizer.eps": o.eps, "optimizer.weight_decay": o.weight_decay,
        "optimizer.implementation": "fused" if cuda else "foreach",
        "debug.seed": cfg.run.seed,
        "job.dump_folder": os.path.join(tempfile.gettempdir(), "torchtitan-peer"),  # its comm traces, not the repo
    }
    argv = [x for k, v in flags.items() for x in (f"--{k}", str(v))]
    argv.append("--compile.enable" if args.compile else "--compile.no-enable")
    return tt.ConfigManager().parse_args(argv)


def model_args(tt, cfg: Config, jc, cuda: bool):
    """The Qwen3 flavor's args with our config's shape written over them; (args, [(field, flavor value, ours)])."""
    m = cfg.model
    if m.first_k_dense:
        raise SystemExit(f"model.first_k_dense={m.first_k_dense}: torchtitan's Qwen3 puts an MoE in every layer; "
                         "this peer benchmark is for Qwen3-shaped configs (model.first_k_dense=0)")
    if m.shared_expert_ffn_hidden_size % m.moe_ffn_hidden_size:
        raise SystemExit(f"model.shared_expert_ffn_hidden_size={m.shared_expert_ffn_hidden_size} is not a multiple of "
                         f"model.moe_ffn_hidden_size={m.moe_ffn_hidden_size}: torchtitan sizes shared experts in "
                         "units of the routed expert width")
    base = tt.spec.model_args[FLAVOR]
    moe = dataclasses.replace(
        base.moe_args, num_experts=m.num_experts, top_k=m.top_k,
        num_shared_experts=m.shared_expert_ffn_hidden_size // m.moe_ffn_hidden_size,
        score_func=m.score_func, route_norm=m.norm_topk_prob, route_scale=m.routed_scaling_factor,
        num_expert_groups=m.num_groups or None, num_limited_groups=m.topk_groups or None,
        use_grouped_mm=cuda)  # on CPU torchtitan's for-loop experts (torch._grouped_mm on CPU varies by version)
    ours = dict(dim=m.hidden_size, n_layers=m.num_layers, n_heads=m.num_heads, n_kv_heads=m.num_kv_heads,
                head_dim=m.kv_channels, vocab_size=m.vocab_size, qk_norm=m.qk_norm, rope_theta=m.rope_theta,
                norm_eps=m.norm_eps, moe_enabled=True, moe_inter_dim=m.moe_ffn_hidden_size, moe_args=moe,
                enable_weight_tying=False)
    margs = dataclasses.replace(base, **ours)
    margs.update_from_config(jc)  # max_seq_len = training.seq_len, as torchtitan's trainer does
    changed = [(k, getattr(base, k), getattr(margs, k)) for k, v in ours.items()
               if k != "moe_args" and getattr(base, k) != v]
    changed += [(f"moe.{f.name}", getattr(base.moe_args, f.name), getattr(moe, f.name))
                for f in dataclasses.fields(moe) if getattr(base.moe_args, f.name) != getattr(moe, f.name)]
    return margs, changed


def differences(cfg: Config, margs, world: int, mp: str, training_dtype: str = "float32") -> list[str]:
    """What is not the same computation as foldmoe's step at this config, beyond kernels and scheduling."""
    m, moe = cfg.model, margs.moe_args
    out = [f"load balancing: foldmoe {m.aux_loss_type} aux loss x{m.aux_loss_coeff:g}"
           + (f" + bias rate {m.bias_update_rate:g}" if m.bias_update_rate else "")
           + "; torchtitan's Qwen3 recipe none (no aux loss; its optimizer builder registers no expert-bias update, "
           f"so the load_balance_coeff={moe.load_balance_coeff} bias stays 0)",
           f"attention: torchtitan {margs.attn_type}, {margs.attn_mask_type} over the whole {cfg.data.seq_len}-token "
           "sequence; foldmoe's bench packs several documents per sequence (varlen, document-masked)",
           "loss: torchtitan builds the [tokens, vocab] logits and casts them to fp32; foldmoe's default chunked "
           "cross-entropy kernel never builds them",
           f"router: torchtitan's gate GEMM runs in {mp} (the compute dtype), softmax in fp32; foldmoe's in fp32",
           "weight decay: torchtitan decays every parameter; foldmoe skips norms and biases (ndim < 2)",
           "lr: constant optimizer.lr (as bench_train_step; bench_parallel_step follows its warmup schedule): "
           "it changes the loss values, not the step time"]
    if m.z_loss_coeff or m.capacity_factor:
        out.append(f"foldmoe z_loss_coeff={m.z_loss_coeff} capacity_factor={m.capacity_factor}: torchtitan has "
                   "neither (dropless, no z-loss)")
    o = cfg.optimizer
    ours = (f"; foldmoe: run.dtype={cfg.run.dtype}, optimizer.param_dtype={o.param_dtype} (fp32 master weights in "
            f"the optimizer), moment_dtype={o.moment_dtype}")
    if training_dtype == "bfloat16":
        out.append("precision: torchtitan training.dtype=bfloat16: parameters, gradients and AdamW moments in bf16, "
                   "no fp32 master weights (updates below a weight's bf16 resolution are lost)" + ours)
    else:
        out.append("precision: " + (f"FSDP2 MixedPrecisionPolicy(param {mp}, reduce float32) over fp32 master "
                                    "weights, no autocast (torchtitan with dp_shard > 1)" if world > 1 else
                                    f"torch.autocast {mp} over fp32 weights (torchtitan on one device, no FSDP)")
                   + ours)
    return out


def fixed_batch(cfg: Config, dp_rank: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`data.grad_accum` micro-batches of (input ids, labels) [mbs, seq_len], shifted by one as torchtitan's
    dataloader does; seeded by (seed, dp rank): the same every step, different across data-parallel ranks."""
    gen = torch.Generator().manual_seed(cfg.run.seed * 1_000_003 + dp_rank)
    d = cfg.data
    out = []
    for _ in range(d.grad_accum):
        ids = torch.randint(0, cfg.model.vocab_size, (d.micro_batch_size, d.seq_len + 1), generator=gen)
        out.append((ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)))
    return out


def init_process_group(tt, jc, cuda: bool) -> tuple[int, int, torch.device]:
    """(rank, world, device). torchtitan's own init on CUDA (nccl, its flight-recorder settings); gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if not cuda:
        if world > 1:
            dist.init_process_group("gloo")
        return rank, world, torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    if world > 1:
        tt.dist_utils.init_distributed(jc.comm, base_folder=jc.job.dump_folder)
    return rank, world, device


def build(tt, cfg: Config, jc, pdims, device, cuda: bool):
    """Model, optimizers, loss and contexts as torchtitan's trainer builds them (non-PP path of train.py)."""
    margs, changed = model_args(tt, cfg, jc, cuda)
    with torch.device("meta"), tt.utils.set_default_dtype(tt.dtype_map[jc.training.dtype]):
        model = tt.spec.model_cls(margs)
    _, titan_flops_tok = margs.get_nparams_and_flops(model, jc.training.seq_len)
    model = tt.spec.parallelize_fn(model, pdims, jc)
    if not cuda and pdims.world_size > 1:
        gloo_sum_only(model)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return types.SimpleNamespace(
        model=model, margs=margs, changed=changed, titan_flops_tok=titan_flops_tok,
        optimizers=tt.spec.build_optimizers_fn([model], jc.optimizer, pdims), loss_fn=tt.spec.build_loss_fn(jc),
        amp=tt.dist_utils.maybe_enable_amp(pdims, jc.training.mixed_precision_param, device.type),
        train_context=tt.dist_utils.get_train_context(False))


def make_step(tt, t, jc, pdims, batch, device, cuda: bool):
    """torchtitan's train_step (non-PP): per micro-batch loss sum / global tokens, backward; clip; step. The step
    returns this rank's share of the mean loss (summed over ranks after the timed steps)."""
    params = list(t.model.parameters())
    global_tokens = sum(labels.numel() for _, labels in batch) * pdims.dp_shard

    def step() -> torch.Tensor:
        t.optimizers.zero_grad()
        local = torch.zeros((), device=device)
        for inputs, labels in batch:
            with t.train_context():
                with t.amp:
                    pred = t.model(inputs)
                    loss = t.loss_fn(pred, labels) / global_tokens
                del pred
                loss.backward()
            local += loss.detach()
        tt.dist_utils.clip_grad_norm_(params, jc.training.max_norm, foreach=True, ep_enabled=pdims.ep_enabled)
        t.optimizers.step()
        if cuda:
            torch.cuda.synchronize(device)
        return local

    return step


def time_steps(step, args, device, cuda: bool, rank: int, world: int) -> tuple[list[float], float, float]:
    """(mean loss per step, median step ms, peak GiB). As bench_parallel_step: a step is as slow as its slowest rank
    (max over ranks per step, then the median); peak memory is the max over ranks, from the first timed step on."""
    losses, times = [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup and cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        losses.append(step())
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        if rank == 0:
            print(f"[torchtitan] step {i + 1} rank-0 loss {float(losses[-1]) * world:.4f} "
                  f"{time.perf_counter() - t0:.3f} s", flush=True)
    step_t = torch.tensor(times, dtype=torch.float64, device=device)
    mem = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0], device=device)
    loss_t = torch.stack(losses)
    if world > 1:
        dist.all_reduce(step_t, op=dist.ReduceOp.MAX)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        dist.all_reduce(loss_t)
    return loss_t.tolist(), statistics.median(step_t.tolist()) * 1000, mem.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel degree (torchtitan: EP over dp_shard); "
                                                        "1 or the world size")
    ap.add_argument("--compile", action="store_true", help="torchtitan's per-block torch.compile (and the loss)")
    ap.add_argument("--ac", default="none", choices=["none", "selective", "full"],
                    help="torchtitan's activation checkpointing mode (default none)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="torchtitan's training.dtype: bfloat16 keeps parameters, gradients and AdamW state in bf16 "
                         "with no fp32 master copy (the issue's reference figures); default float32 + autocast")
    ap.add_argument("--json", default=None, help="append the figures as one JSON line to this file")
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if args.ep not in (1, world):
        raise SystemExit(f"--ep {args.ep} with {world} process(es): EP here spans every rank (torchtitan's EP over "
                         f"dp_shard), so start {args.ep} processes (torchrun --nproc_per_node={args.ep}) or use --ep 1")
    if args.ep > 1 and cfg.model.num_experts % args.ep:
        raise SystemExit(f"--ep {args.ep} does not divide model.num_experts={cfg.model.num_experts}")
    tt = import_torchtitan()
    if not cuda:
        cpu_shims()
    jc = job_config(tt, cfg, args, world, cuda)
    rank, world, device = init_process_group(tt, jc, cuda)
    pdims = tt.ParallelDims(dp_shard=-1, dp_replicate=1, cp=1, tp=1, pp=1, ep=args.ep, etp=1, world_size=world)
    tt.dist_utils.set_determinism(pdims, device, jc.debug, distinct_seed_mesh_dims=["pp"])
    t = build(tt, cfg, jc, pdims, device, cuda)
    dp_rank = pdims.get_mesh("batch").get_local_rank() if pdims.dp_enabled else 0
    step = make_step(tt, t, jc, pdims, fixed_batch(cfg, dp_rank, device), device, cuda)
    losses, step_ms, peak_gib = time_steps(step, args, device, cuda, rank, world)

    tokens_per_step = cfg.data.micro_batch_size * cfg.data.seq_len * cfg.data.grad_accum * pdims.dp_shard
    tps = tokens_per_step / (step_ms / 1000)
    peak = cfg.run.peak_tflops or datasheet_peak(device)
    flops_tok = flops_per_token(cfg.model, cfg.data.seq_len)
    result = {
        "peer": "torchtitan", "torchtitan": importlib.metadata.version("torchtitan"), "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "world": world,
        "layout": {"dp_shard": pdims.dp_shard, "ep": pdims.ep, "expert_sharding": expert_sharding(t.model)},
        "compile": args.compile, "ac": args.ac, "training_dtype": args.dtype,
        "mixed_precision": jc.training.mixed_precision_param,
        "grouped_mm": t.margs.moe_args.use_grouped_mm,
        "tokens_per_step": tokens_per_step, "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / world,
        "mfu": tps * flops_tok / 1e12 / world / peak if peak else None, "peak_tflops": peak,
        "flops_per_token": flops_tok, "torchtitan_flops_per_token": t.titan_flops_tok,
        "median_step_ms": step_ms, "peak_mem_gib": peak_gib if cuda else None,
        "loss_first": losses[0], "loss_last": losses[-1], "losses": losses,
        "flavor_overrides": {k: [str(a), str(b)] for k, a, b in t.changed},
    }
    if rank == 0:
        print_table(result, cfg, t.margs, args, world)
        if args.json:
            with open(args.json, "a") as fh:
                fh.write(json.dumps(result) + "\n")
    if world > 1:
        dist.destroy_process_group()


def expert_sharding(model) -> str:
    """How the routed experts' weights are laid out, read off the model: "efsdp1 x ep2" (EP applied), "fsdp2" (FSDP
    only), "none"."""
    w = next(iter(model.layers.values())).moe.experts.w1
    if not isinstance(w, DTensor):
        return "none"
    return " x ".join(f"{n}{k}" for n, k in zip(w.device_mesh.mesh_dim_names, w.device_mesh.shape))


def print_table(r: dict, cfg: Config, margs, args, world: int) -> None:
    m = margs
    rows = [("peer", f"torchtitan {r['torchtitan']} Qwen3 MoE ('{FLAVOR}' flavor, our config's shape) | torch "
                     f"{r['torch']}"),
            ("device", f"{r['device']} x{world}"),
            ("layout", f"dp_shard {r['layout']['dp_shard']} ep {r['layout']['ep']} ("
                       f"experts sharded over {r['layout']['expert_sharding']}, FSDP2 "
                       f"{'on' if world > 1 else 'off'}) | compile {'on' if args.compile else 'off'} | AC {args.ac} | "
                       f"training.dtype {args.dtype} | "
                       f"experts {'torch._grouped_mm' if r['grouped_mm'] else 'for-loop (CPU)'}"),
            ("shape", f"L{m.n_layers} d{m.dim} heads {m.n_heads}/{m.n_kv_heads}x{m.head_dim} E{m.moe_args.num_experts}"
                      f" top{m.moe_args.top_k} ffn {m.moe_inter_dim} vocab {m.vocab_size} qk_norm {m.qk_norm} rope "
                      f"{m.rope_theta:g} eps {m.norm_eps:g} {m.moe_args.score_func} "
                      f"route_norm {m.moe_args.route_norm}"),
            ("tokens/s (all ranks)", f"{r['tokens_per_s']:,.0f}  ({r['tokens_per_step']:,} tokens/step = mbs "
                                     f"{cfg.data.micro_batch_size} x seq {cfg.data.seq_len} x accum "
                                     f"{cfg.data.grad_accum} x dp {r['layout']['dp_shard']})"),
            ("tokens/s per GPU", f"{r['tokens_per_s_per_gpu']:,.0f}"),
            ("MFU", f"{100 * r['mfu']:.1f}% of {r['peak_tflops']:.0f} TFLOP/s (foldmoe's flops_per_token "
                    f"{r['flops_per_token'] / 1e9:.2f} GFLOP; torchtitan's own estimate "
                    f"{r['torchtitan_flops_per_token'] / 1e9:.2f})" if r["mfu"] is not None
                    else "n/a (no datasheet peak)"),
            ("median step", f"{r['median_step_ms']:.1f} ms  ({args.steps} timed steps after {args.warmup} warmup)"),
            ("peak memory", f"{r['peak_mem_gib']:.2f} GiB" if r["peak_mem_gib"] is not None else "n/a (CPU)"),
            ("loss first -> last", f"{r['loss_first']:.4f} -> {r['loss_last']:.4f} (fixed batch: "
                                   f"{'falls' if r['loss_last'] < r['loss_first'] else 'DOES NOT FALL'})"),
            ("flavor overrides", ", ".join(f"{k} {a}->{b}" for k, (a, b) in r["flavor_overrides"].items()) or "none")]
    notes = differences(cfg, margs, world, r["mixed_precision"], r["training_dtype"])
    rows += [("differences" if i == 0 else "", d) for i, d in enumerate(notes)]
    print("\n".join(f"{k:<22}{v}" for k, v in rows), flush=True)


if __name__ == "__main__":
    main()
