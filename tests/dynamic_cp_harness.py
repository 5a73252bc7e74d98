"""Dynamic-CP variant of `parallel_harness.run_parallel`: each micro-batch runs on the CP block of its own size.

The dataloader sizes every micro-batch (`cp_size`) and hands it to an aligned block of that many CP ranks; this stand-in
gives the k-th micro-batch of size c to block k mod (cp / c). Everything else is the production path of
`parallel_harness` (parallelize -> DistributedOptimizer -> forward_backward_parallel) and its reference and comparison.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from parallel_harness import TIMEOUT_S, _gather_full, spawn_ranks
from services.common.config import Config
from services.trainer.model.transformer import MoETransformer


def place_on_cp_blocks(mbs: list[dict], cp: int, cp_rank: int) -> list[dict]:
    mine, next_block = [], {}
    for mb in mbs:
        c = int(mb["cp_size"])
        block = next_block.get(c, 0)
        next_block[c] = (block + 1) % (cp // c)
        if cp_rank // c == block:
            mine.append(mb)
    return mine


def _worker(rank: int, world: int, cfg: Config, batches, out_dir: str, seed: int) -> None:
    from services.trainer.parallel.groups import init_groups
    from services.trainer.parallel.parallelize import build_optimizer, forward_backward_parallel, parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    try:
        groups = init_groups(cfg)
        model = MoETransformer(cfg.model)
        model.init_weights(seed)
        parallelize(model, cfg, groups)
        opt = build_optimizer(model, cfg, groups)
        named = dict(model.named_parameters())
        losses, grads, norms = [], [], []
        for mbs in batches:
            opt.zero_grad()
            mine = place_on_cp_blocks(mbs, groups.cp.size, groups.cp.rank)
            loss, tokens = forward_backward_parallel(model, mine, groups, cfg, torch.device("cpu"), None, opt)
            opt.finish_grad_sync()
            losses.append(float(loss) / int(tokens))
            grads.append({n: _gather_full(n, g, named[n], groups) for n, g in opt.full_grads().items()})
            norms.append(float(opt.step(cfg.optimizer.lr)))
        opt.wait_params()  # the last step's parameter all-gathers would overlap a next forward; there is none
        params = {n: _gather_full(n, p.detach(), p, groups) for n, p in named.items()}
        torch.save({"losses": losses, "grads": grads, "params": params, "norms": norms},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_dynamic_cp(cfg: Config, batches: list[list[dict]], world: int, out_dir: str, seed: int = 7) -> dict:
    # Losses are all-reduced and gradients/parameters gathered on every rank: rank 0 holds the whole picture.
    return spawn_ranks(_worker, (world, cfg, batches, out_dir, seed), world, out_dir)[0]
