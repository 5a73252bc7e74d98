"""Dynamic-CP variant of `parallel_harness.run_parallel`: each micro-batch runs on the CP block of its own size.

The dataloader sizes every micro-batch (`cp_size`) and sends all of a dp rank's micro-batches to each of its CP ranks;
`forward_backward_parallel` picks each block's share (`context_parallel.cp_share`). This is the production path of
`parallel_harness` (parallelize -> DistributedOptimizer -> forward_backward_parallel) with its reference and comparison.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from parallel_harness import TIMEOUT_S, _gather_full, _memory_policy, spawn_ranks
from services.common.config import Config
from services.trainer.model.transformer import MoETransformer


def _worker(rank: int, world: int, cfg: Config, batches, out_dir: str, seed: int) -> None:
    from services.trainer.parallel.groups import init_groups
    from services.trainer.parallel.parallelize import build_optimizer, forward_backward_parallel, parallelize
    from services.trainer.train import mtp_loss_of_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    try:
        groups = init_groups(cfg)
        model = MoETransformer(cfg.model)
        model.init_weights(seed)
        parallelize(model, cfg, groups)
        _memory_policy(model, cfg)  # after parallelization, as train.py applies it
        opt = build_optimizer(model, cfg, groups)
        named = dict(model.named_parameters())
        losses, mtp_losses, grads, norms = [], [], [], []
        for mbs in batches:
            opt.zero_grad()
            loss, tokens = forward_backward_parallel(model, mbs, groups, cfg, torch.device("cpu"), None, opt)
            opt.finish_grad_sync()
            losses.append(float(loss) / int(tokens))
            mtp_losses.append(float(mtp_loss_of_step(model, groups, torch.device("cpu"))) if cfg.model.mtp_num_layers else None)
            grads.append({n: _gather_full(n, g, named[n], groups) for n, g in opt.full_grads().items()})
            norms.append(float(opt.step(cfg.optimizer.lr)))
        opt.wait_params()  # the last step's parameter all-gathers would overlap a next forward; there is none
        params = {n: _gather_full(n, p.detach(), p, groups) for n, p in named.items()}
        torch.save({"losses": losses, "mtp_losses": mtp_losses, "grads": grads, "params": params, "norms": norms},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_dynamic_cp(cfg: Config, batches: list[list[dict]], world: int, out_dir: str, seed: int = 7) -> dict:
    # Losses are all-reduced over every rank; gradients and parameters are gathered at full shape on every rank of a
    # pipeline stage: merged over the stages here (with one stage, rank 0 holds the whole picture).
    results = spawn_ranks(_worker, (world, cfg, batches, out_dir, seed), world, out_dir)
    merged = {**results[0], "grads": [{} for _ in batches], "params": {}}
    for r in results:
        for step, grads in enumerate(r["grads"]):
            for name, g in grads.items():
                merged["grads"][step].setdefault(name, g)
        for name, p in r["params"].items():
            merged["params"].setdefault(name, p)
    return merged
