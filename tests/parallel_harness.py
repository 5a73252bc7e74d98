"""Multi-process parity harness: N gloo processes on CPU run the production parallel path against one process.

    cfg = tiny_config(ep=2)                       # tiny fp32 model + the parallel layout under test
    batches = make_batches(cfg.model, steps=3, micro=4, tokens=32)
    ref = run_reference(cfg, batches)            # one process over all micro-batches of each step
    par = run_parallel(cfg, batches, world=2)    # init_groups -> parallelize -> DistributedOptimizer, as train.py does
    assert_parity(ref, par)

Both sides start from `init_weights(seed)` of the full model (the parallel side slices it), see the same micro-batches
(rank with data-parallel index d takes the d-th contiguous block of each step's list; TP and CP peers share it), use
AdamW with the same settings and clipping, and record every step's mean token loss (and, with MTP, the step record's
`mtp_loss`), every parameter's gradient reassembled to full shape (before clipping) and, at the end, every parameter. Optional probes record the router's kept
masks and the MoE layers' outputs per (micro-batch, layer), and whether gradient reductions began before backward ended.
Where the replicas share statistics pass by pass (the global aux loss), the reference runs `replicas_together(batches,
dp)`: each of its micro-batches is the replicas' j-th micro-batches concatenated.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.common.config import Config, ModelConfig
from services.trainer.model.loss import IGNORE_INDEX
from services.trainer.model.moe.moe_layer import MoELayer
from services.trainer.model.moe.router import Router
from services.checkpointer.store import CheckpointStore
from services.trainer.model.transformer import MoETransformer
from services.trainer.optim import MasterWeightAdamW, build_adamw, clip_and_step, set_lr
from services.trainer.parallel.groups import single_process
from services.trainer.step import count_loss_tokens, forward_backward
from services.trainer.train import advance_router_bias, mtp_loss_of_step

RTOL = 1e-5  # relative L2 error allowed for every gradient, parameter and step loss (fp32)
LR = 1e-2
TIMEOUT_S = 120.0
# A compiled model's first step waits for inductor to build its CPU kernels with a C++ compiler. With a cold cache that
# took 159 s per rank on the H100 machine's host (torch 2.11) for the pp2 case of test_model_compile.py, 22 s on the
# 2-core CI machine: one rank's compile is another's wait in a collective.
COMPILE_TIMEOUT_S = 600.0


def timeout_of(cfg: Config) -> float:
    """Seconds a parallel run of `cfg` may take, and a rank may wait in one collective."""
    return COMPILE_TIMEOUT_S if cfg.model.compile else TIMEOUT_S


def tiny_config(**parallel) -> Config:
    cfg = Config()
    m = cfg.model
    for k, v in dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
                     first_k_dense=0, num_experts=4, top_k=2, moe_ffn_hidden_size=16, aux_loss_coeff=1e-2).items():
        setattr(m, k, v)
    # clip_grad below the tiny model's gradient norm: clipping is active, so every parity run checks the global norm
    cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.optimizer.clip_grad = LR, 0.1, 0.2
    # Adam turns a gradient difference d on a near-zero gradient into an update difference of up to lr·d/eps: a larger
    # eps keeps fp32 summation-order differences (other reduction orders in parallel) at rounding level over the steps.
    cfg.optimizer.eps = 1e-6
    cfg.parallel.grad_bucket_mb = 0.01  # several buckets even for the tiny model, so bucketing and overlap are exercised
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


def make_batches(cfg: ModelConfig, steps: int, micro: int, tokens: int = 32, seed: int = 0) -> list[list[dict]]:
    """`steps` lists of `micro` packed micro-batches: several documents each, a padding segment, ignored labels."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        mbs = []
        for _ in range(micro):
            lengths, left = [], tokens - 3
            while left > 0:
                n = min(left, int(torch.randint(3, tokens // 2, (1,), generator=gen)))
                lengths.append(n)
                left -= n
            lengths.append(3)  # padding run
            labels = torch.randint(0, cfg.vocab_size, (tokens,), generator=gen)
            labels[-3:] = IGNORE_INDEX
            labels[torch.rand(tokens, generator=gen) < 0.1] = IGNORE_INDEX
            mbs.append({"tokens": torch.randint(0, cfg.vocab_size, (tokens,), generator=gen), "labels": labels,
                        "position_ids": torch.cat([torch.arange(n) for n in lengths]),
                        "cu_seqlens": torch.tensor([0] + lengths).cumsum(0).to(torch.int32)})
        out.append(mbs)
    return out


def concat_micro_batches(mbs: list[dict]) -> dict:
    """One packed micro-batch holding `mbs` one after another: tokens, labels and position ids concatenated, the
    documents' boundaries shifted (document masking keeps attention inside each document, so every token sees what it
    saw; the token-normalised loss of a step is unchanged)."""
    starts = torch.tensor([0] + [int(mb["cu_seqlens"][-1]) for mb in mbs]).cumsum(0)
    cu = [mbs[0]["cu_seqlens"][:1]] + [mb["cu_seqlens"][1:] + start for mb, start in zip(mbs, starts)]
    return {"tokens": torch.cat([mb["tokens"] for mb in mbs]), "labels": torch.cat([mb["labels"] for mb in mbs]),
            "position_ids": torch.cat([mb["position_ids"] for mb in mbs]),
            "cu_seqlens": torch.cat(cu).to(torch.int32)}


def replicas_together(batches: list[list[dict]], dp: int) -> list[list[dict]]:
    """The batches as one process sees a data-parallel step whose replicas share statistics pass by pass (the global
    aux loss): its j-th micro-batch is the dp replicas' j-th micro-batches together (replica d runs the d-th contiguous
    block of each step, as `run_parallel` deals them)."""
    out = []
    for mbs in batches:
        per_rank = len(mbs) // dp
        out.append([concat_micro_batches([mbs[d * per_rank + j] for d in range(dp)]) for j in range(per_rank)])
    return out


# ---------------------------------------------------------------- probes


class _Probe:
    """Router kept masks and MoE outputs, keyed by (step, micro-batch index in the step, layer name)."""

    def __init__(self, model: torch.nn.Module):
        self.key: tuple[int, int] = (0, 0)
        self.kept: dict[tuple, torch.Tensor] = {}
        self.moe_out: dict[tuple, torch.Tensor] = {}
        for name, m in model.named_modules():
            if isinstance(m, Router):
                m.register_forward_hook(self._router_hook(name))
            elif isinstance(m, MoELayer):
                m.register_forward_hook(self._moe_hook(name))

    def _router_hook(self, name):
        def hook(module, args, routing):
            if routing.kept is not None:
                self.kept[(*self.key, name)] = routing.kept.clone()
        return hook

    def _moe_hook(self, name):
        def hook(module, args, out):
            if isinstance(out, torch.Tensor):  # not a staged (paused) forward of `parallel.ep_overlap`
                self.moe_out[(*self.key, name)] = out.detach().clone()
        return hook


# ---------------------------------------------------------------- the single-process reference


def _memory_policy(model: torch.nn.Module, cfg: Config) -> None:
    from services.trainer.model.recompute import apply_memory_policy

    m = cfg.model
    apply_memory_policy(model, m.recompute, m.offload, m.recompute_layers, m.offload_layers)


def autocast_of(cfg: Config, as_on_gpu: bool = False) -> torch.dtype | None:
    """As the trainer: the CPU computes in fp32, under bf16 autocast with bf16 parameters. `as_on_gpu`: as the trainer
    on a GPU, under `run.dtype` autocast whatever the parameters' dtype."""
    if as_on_gpu:
        return torch.bfloat16 if cfg.run.dtype == "bf16" else None
    return torch.bfloat16 if cfg.optimizer.param_dtype == "bf16" else None


def run_reference(cfg: Config, batches: list[list[dict]], seed: int = 7) -> dict:
    model = MoETransformer(cfg.model)
    model.init_weights(seed)
    _memory_policy(model, cfg)
    opt = build_adamw(model, cfg.optimizer)
    probe = _Probe(model)
    for m in model.moe_layers():
        m.aux_loss_scale = 1.0 / len(batches[0])
    losses, mtp_losses, grads, loads, norms = [], [], [], [], []
    for step, mbs in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        set_lr(opt, cfg.optimizer.lr)
        tokens = count_loss_tokens(mbs)
        loss = torch.zeros(())
        for i, mb in enumerate(mbs):
            probe.key = (step, i)
            loss += forward_backward(model, [mb], tokens, torch.device("cpu"), autocast_of(cfg))
        losses.append(float(loss) / tokens)
        mtp_losses.append(float(mtp_loss_of_step(model, single_process(), torch.device("cpu"))) if model.mtp else None)
        grad_of = opt.grad if isinstance(opt, MasterWeightAdamW) else (lambda p: p.grad)  # fp32 sums with bf16 params
        grads.append({n: grad_of(p).clone() for n, p in model.named_parameters() if grad_of(p) is not None})
        norms.append(float(clip_and_step(opt, model.parameters(), cfg.optimizer.clip_grad)))
        loads.append(list(advance_router_bias(model, cfg)))  # once per optimizer step, as the training loop
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "mtp_losses": mtp_losses, "grads": grads, "params": params, "kept": probe.kept,
            "moe_out": probe.moe_out, "loads": loads, "norms": norms}


# ---------------------------------------------------------------- the parallel run


def _gather_full(name: str, t: torch.Tensor, p: torch.nn.Parameter, groups) -> torch.Tensor:
    """A local piece (of a parameter or its gradient) reassembled to the single-device shape."""
    from services.trainer.parallel.expert_parallel import full_expert_tensor

    if hasattr(p, "expert_box"):
        global_shape, offsets = p.expert_box
        piece = t.reshape(p.shape)
        piece = piece.view(piece.shape[0], piece.shape[1], 2, -1) if len(global_shape) == 4 else piece
        axis = groups.ep_etp
        if axis.size == 1:
            return full_expert_tensor([(piece, offsets)], global_shape)
        pieces = [torch.empty_like(piece) for _ in range(axis.size)]
        dist.all_gather(pieces, piece.contiguous(), group=axis.group)
        offs = [torch.empty(len(offsets), dtype=torch.int64) for _ in range(axis.size)]
        dist.all_gather(offs, torch.tensor(offsets), group=axis.group)
        return full_expert_tensor([(pc, tuple(o.tolist())) for pc, o in zip(pieces, offs)], global_shape)
    dim = getattr(p, "tensor_parallel_dim", None)
    if dim is None or groups.tp.size == 1:
        return t.clone()
    parts = [torch.empty_like(t) for _ in range(groups.tp.size)]
    dist.all_gather(parts, t.contiguous(), group=groups.tp.group)
    return torch.cat(parts, dim=dim)


def _worker(rank: int, world: int, cfg: Config, batches, out_dir: str, seed: int, as_on_gpu: bool = False,
            record_steps: bool = False) -> None:
    from services.trainer.parallel.expert_parallel import sync_expert_load
    from services.trainer.parallel.groups import init_groups
    from services.trainer.parallel.parallelize import build_optimizer, forward_backward_parallel, parallelize

    torch.set_num_threads(1)
    # A file rendezvous in the run's own directory: no free-port race with other tests running at the same time.
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_of(cfg)))
    try:
        groups = init_groups(cfg)
        model = MoETransformer(cfg.model)
        model.init_weights(seed)
        parallelize(model, cfg, groups)
        _memory_policy(model, cfg)  # after parallelization, as train.py applies it
        probe = _Probe(model)
        opt = build_optimizer(model, cfg, groups)
        overlap = []  # (buckets launched when the first block's backward ran, total buckets) per backward
        first_block = model.layers[min(model.layers.keys(), key=int)]
        first_block.register_full_backward_hook(lambda *a: overlap.append((len(opt.launch_log), len(opt.buckets))))
        # Per step, per forward: parameter all-gathers not yet waited for when forward reaches the first block.
        pending: list[list[int]] = []
        first_block.register_forward_pre_hook(lambda *a: pending[-1].append(len(opt._gathers)))
        named = dict(model.named_parameters())
        losses, mtp_losses, grads, loads, norms, entering = [], [], [], [], [], []
        for step, mbs in enumerate(batches):
            per_rank = len(mbs) // groups.dp.size
            first = groups.dp.rank * per_rank
            mine = mbs[first:first + per_rank]
            if record_steps:  # waits for the last step's all-gathers: no overlap with this forward
                opt.wait_params()
                entering.append({n: _gather_full(n, p.detach(), p, groups) for n, p in named.items()})
            opt.zero_grad()
            overlap.clear()
            pending.append([])
            local_index = iter(range(first, first + per_rank))
            handle = model.register_forward_pre_hook(lambda *a: setattr(probe, "key", (step, next(local_index, -1))))
            loss, tokens = forward_backward_parallel(model, mine, groups, cfg, torch.device("cpu"),
                                                     autocast_of(cfg, as_on_gpu), opt)
            handle.remove()
            opt.finish_grad_sync()
            losses.append(float(loss) / int(tokens))
            mtp_losses.append(float(mtp_loss_of_step(model, groups, torch.device("cpu"))) if cfg.model.mtp_num_layers
                              else None)
            grads.append({n: _gather_full(n, g, named[n], groups) for n, g in opt.full_grads().items()})
            sync_expert_load(model, groups)
            loads.append(list(advance_router_bias(model, cfg)))
            norms.append(float(opt.step(cfg.optimizer.lr)))
        opt.wait_params()  # the last step's parameter all-gathers overlap the next forward; there is none
        params = {n: _gather_full(n, p.detach(), p, groups) for n, p in named.items()}
        torch.save({"losses": losses, "mtp_losses": mtp_losses, "grads": grads, "params": params, "kept": probe.kept, "moe_out": probe.moe_out,
                    "overlap": overlap[-1:], "pending": pending, "loads": loads, "norms": norms, "entering": entering,
                    "last_stage": groups.is_last_stage},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        # No rank tears its connections down while a peer may still be finishing its last transfers: a gloo peer that
        # loses a connection mid-transfer aborts the process ("terminate called without an active exception"), which
        # a loaded 2-core machine made happen in one run of the 4-rank pipeline test.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_ranks(worker, args: tuple, world: int, out_dir: str, timeout_s: float = TIMEOUT_S) -> list[dict]:
    """Run `worker(rank, *args)` on `world` spawned processes; returns what each saved as out_dir/rank<r>.pt. A rank
    that raises fails the test with its traceback; a run past `timeout_s` (a mismatched collective hangs) is killed."""
    ctx = mp.start_processes(worker, args=args, nprocs=world, start_method="spawn", join=False)
    try:
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"parallel run of {world} processes did not finish in {timeout_s:.0f} s "
                                   f"(a collective is probably mismatched between ranks)")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        raise AssertionError(f"a rank failed:\n{e}") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


def run_parallel(cfg: Config, batches: list[list[dict]], world: int, out_dir: str, seed: int = 7,
                 as_on_gpu: bool = False, record_steps: bool = False) -> dict:
    """Run the layout `cfg.parallel` on `world` gloo processes; merge what every rank recorded. `as_on_gpu`: compute
    under bf16 autocast with fp32 parameters too (see `autocast_of`). `record_steps`: also record every parameter as
    each step's forward reads it (`entering`, one dict per step; the parameter all-gathers then no longer overlap it)."""
    os.makedirs(out_dir, exist_ok=True)
    results = spawn_ranks(_worker, (world, cfg, batches, out_dir, seed, as_on_gpu, record_steps), world, out_dir,
                          timeout_of(cfg))
    merged = {"losses": next(r["losses"] for r in results if r["last_stage"]), "mtp_losses": results[0]["mtp_losses"],
              "grads": [], "params": {},
              "kept": {}, "moe_out": {}, "overlap": [r["overlap"] for r in results], "pending": [r["pending"] for r in results],
              "loads": results[0]["loads"],
              "norms": results[0]["norms"], "entering": [], "ranks": results}
    for step in range(len(batches)):
        merged["grads"].append({})
        for r in results:
            for n, g in r["grads"][step].items():
                merged["grads"][step].setdefault(n, g)
    for step in range(len(results[0]["entering"])):
        merged["entering"].append({})
        for r in results:
            for n, p in r["entering"][step].items():
                merged["entering"][step].setdefault(n, p)
    for r in results:
        for key in ("params", "kept", "moe_out"):
            for k, v in r[key].items():
                merged[key].setdefault(k, v)
    return merged


# ---------------------------------------------------------------- comparison


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def assert_parity(ref: dict, par: dict, rtol: float = RTOL, params: bool = True) -> None:
    """Every step's loss (and MTP loss), every parameter's gradient each step and (optionally) every final parameter
    agree."""
    for step, (lr, lp) in enumerate(zip(ref["losses"], par["losses"], strict=True)):
        assert abs(lp - lr) <= rtol * abs(lr), f"step {step}: loss {lp} != reference {lr}"
    both = "mtp_losses" in ref and "mtp_losses" in par
    for step, (lr, lp) in enumerate(zip(ref["mtp_losses"], par["mtp_losses"], strict=True) if both else ()):
        assert (lp is None) == (lr is None) and (lr is None or abs(lp - lr) <= rtol * abs(lr)), \
            f"step {step}: MTP loss {lp} != reference {lr}"
    for step, (gr, gp) in enumerate(zip(ref["grads"], par["grads"], strict=True)):
        assert gp.keys() == gr.keys(), f"step {step}: gradients of {sorted(gp.keys() ^ gr.keys())} on one side only"
        for name in gr:
            assert gp[name].shape == gr[name].shape, f"{name}: shape {tuple(gp[name].shape)} != {tuple(gr[name].shape)}"
            err = rel_err(gp[name], gr[name])
            assert err <= rtol, f"step {step}: gradient of {name} differs from the reference by {err:.2e} (relative)"
    for step, (nr, np_) in enumerate(zip(ref["norms"], par["norms"], strict=True)):
        assert abs(np_ - nr) <= rtol * nr, f"step {step}: global grad norm {np_} != reference {nr}"
    if params:
        assert par["params"].keys() == ref["params"].keys()
        for name, p in ref["params"].items():
            err = rel_err(par["params"][name], p)
            assert err <= rtol, f"parameter {name} after {len(ref['losses'])} steps differs by {err:.2e} (relative)"


def assert_bf16_master_parity(ref: dict, par: dict) -> None:
    """Two runs with bf16 parameters and fp32 master weights whose gradients or norms are summed in another order
    (another layout, or the same layout with fp32 parameters under autocast). Steps 1-2 agree to fp32 reordering (1e-6).
    From step 3 on a master whose last bits differ can round to a neighbouring bf16 value, 2^-8 = 3.9e-3 away relative
    to it, and the gradients computed from those weights move by less than that: 4e-3. Whether any master flips depends
    on the CPU's summation order: the TP2 bf16 test saw none on one host and gradients 2.0e-3 apart at step 3 on
    another (bitwise equal before); the DP2 one 7.4e-4."""
    first = {k: ref[k][:2] for k in ("losses", "grads", "norms")}
    assert_parity(first, {k: par[k][:2] for k in first}, rtol=1e-6, params=False)
    assert_parity(ref, par, rtol=4e-3)


def neighbouring_bf16_copies(fp32: dict[str, torch.Tensor], bf16: dict[str, torch.Tensor]) -> int:
    """How many elements of the bf16 parameters in `bf16` are not the fp32 parameters of `fp32` rounded to nearest
    even. Each must be the neighbouring bf16 value, and they must be rare (a master on a rounding midpoint, see
    `assert_bf16_run_matches_fp32_run`): a bf16 copy made by another rule, or a master that lost its remainder, differs
    in a large share of the elements."""
    flipped, total = 0, 0
    for name, got in bf16.items():
        if got.dtype != torch.bfloat16:
            continue
        want = fp32[name].to(torch.bfloat16)
        apart = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
        assert int(apart.max()) <= 1, f"{name}: a bf16 copy {int(apart.max())} bf16 steps from its master"
        flipped, total = flipped + int(apart.sum()), total + got.numel()
    assert flipped <= total // 1000, f"{flipped} of {total} bf16 copies are not their masters rounded to nearest even"
    return flipped


def assert_bf16_run_matches_fp32_run(fp32: dict, bf16: dict, exact_steps: int = 1, grad_rtol: float = 1e-6) -> None:
    """A layout run with `optimizer.param_dtype=bf16` against the same layout with fp32 parameters under bf16 autocast
    (`run_parallel(..., as_on_gpu=True)`), both run with `record_steps=True`. Every backward produces the same
    gradients from the same bf16 weights, summed in fp32 by the distributed optimizer either way, and both update fp32
    masters with kernels/adamw.py. The weights are the same until a master lies on a bf16 rounding midpoint: autocast
    rounds it to nearest even, the bf16 parameter (`split_master`) away from zero, since its int16 remainder cannot
    hold +0x8000; or the masters differ in their last bits, because the global grad norm (the clip divisor) is summed
    in another order (bf16 parameters are bucketed apart from fp32 ones), and one near a midpoint rounds to the other
    side. Whether that happens depends on the values, not on the code: exact ties are rare for drawn weights (about
    2^-17 per element: 0.2 per seed of the TP2 model's initial values, 86 in seeds 0-399), common for masters near
    zero after an Adam step (the low bits of `w - lr * ...` are zeros). From such a flip on the runs are two bf16
    trajectories: every bf16 rounding downstream may go the other way and a token's top-k with it (measured after a
    flip: gradients 2e-4 to 0.2 apart, losses 3.2e-5 at most). So: the steps whose forward read the same bf16
    weights agree to fp32 reordering (1e-6; their gradients to `grad_rtol`, where a test measured more, see
    test_parallel_ep.py), the rest in their losses (1e-4); with no flip, the parameters after
    rounding the fp32 run's to the bf16 run's dtypes within `assert_bf16_master_parity`'s 4e-3. The matrices must be
    bf16, the `optim.stays_fp32` ones fp32. At least the first `exact_steps` steps must read the same weights: a seed
    whose initial values hold a tie would leave nothing but the losses to compare, so a test picks a seed whose values
    hold none (`exact_steps=0`: a test of a tie)."""
    from services.trainer.optim import stays_fp32

    for name, p in bf16["params"].items():
        want = torch.float32 if stays_fp32(name, p) else torch.bfloat16
        assert p.dtype == want, f"{name} is {p.dtype} with bf16 parameters, expected {want}"
    assert fp32["entering"] and bf16["entering"], "run both sides with run_parallel(..., record_steps=True)"
    steps = len(bf16["entering"])
    same = next((step for step, (a, b) in enumerate(zip(fp32["entering"], bf16["entering"], strict=True))
                 if neighbouring_bf16_copies(a, b)), steps)
    assert same >= exact_steps, f"the runs read other bf16 weights from step {same}: pick a seed whose initial " \
                                f"values put no weight on a bf16 rounding tie"
    exact = {k: fp32[k][:same] for k in ("losses", "grads", "norms")}
    assert_parity({**exact, "grads": []}, {"losses": bf16["losses"][:same], "grads": [], "norms": bf16["norms"][:same]},
                  rtol=1e-6, params=False)
    assert_parity({"losses": [], "grads": exact["grads"], "norms": []},
                  {"losses": [], "grads": bf16["grads"][:same], "norms": []}, rtol=grad_rtol, params=False)
    for step in range(same, steps):
        a, b = fp32["losses"][step], bf16["losses"][step]
        assert abs(b - a) <= 1e-4 * abs(a), f"step {step} (bf16 weights flipped at step {same}): loss {b} != {a}"
    if same == steps:
        rounded = {n: p.to(bf16["params"][n].dtype) for n, p in fp32["params"].items()}
        assert_parity({"losses": [], "grads": [], "norms": [], "params": rounded},
                      {"losses": [], "grads": [], "norms": [], "params": bf16["params"]}, rtol=4e-3)


def assert_same_rank_replicas(par: dict, key: str = "params") -> None:
    """Copies of a tensor held by several ranks (DP replicas after the all-gather) are bit-identical."""
    seen: dict[str, torch.Tensor] = {}
    for r in par["ranks"]:
        for n, t in r[key].items():
            if n in seen:
                assert torch.equal(seen[n], t), f"replicas of {n} differ between ranks"
            seen.setdefault(n, t)


# ---------------------------------------------------------------- checkpoints written by a parallel layout


def save_step_one(root: str, rank: int, world: int, shards: dict) -> None:
    """This rank's written shards as one part of step 1 of a checkpoint in `root`; rank 0 commits once all ranks have."""
    store = CheckpointStore(root, keep_last=0)
    written = {n: s for n, s in shards.items() if s.written}
    part = store.write_part(1, rank, 0, {n: s.tensor.contiguous() for n, s in written.items()},
                            {n: (list(s.global_shape), list(s.offsets)) for n, s in written.items()})
    store.write_rank_record(1, rank, [part], {"rank": rank})
    if world > 1:
        dist.barrier()
    if rank == 0:
        store.commit("test", 1, world)


def trained_one_step(cfg, groups, seed: int):
    """A model of `cfg`'s layout after one AdamW step (moments not zero), and its optimizer."""
    from services.trainer.parallel.parallelize import build_optimizer, forward_backward_parallel, parallelize

    model = MoETransformer(cfg.model)
    model.init_weights(seed)
    parallelize(model, cfg, groups)
    opt = build_optimizer(model, cfg, groups)
    opt.zero_grad()
    forward_backward_parallel(model, make_batches(cfg.model, 1, 2, seed=seed)[0], groups, cfg, torch.device("cpu"),
                              None, opt)
    opt.finish_grad_sync()
    opt.step(cfg.optimizer.lr)
    return model, opt
