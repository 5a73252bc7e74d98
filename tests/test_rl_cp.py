"""RL steps under static context parallelism reproduce one process on the same trajectories.

The harness is tests/test_rl_folded.py's (`run_and_compare`): the same fixed trajectory groups (completions, recorded
routing and log-probs of the rollout engine, seeded rewards), two `rl_step`s per layout with the pre-training
DistributedOptimizer, every DP replica on the micro-batches the dataloader's RL source deals it (the CP ranks of a
replica get the same ones and each runs its zigzag cut: rl/cp_sharding.py), against one process running `rl_step` with
torch's AdamW. Compared: every metric of every step on every rank (loss, clip fraction, KL, log-prob mismatch, rollout
KL, importance weights, grad norm, data figures) and every weight rank 0 gathers after every step (`WeightGather`).
Tolerance (fp32): 1e-5 relative L2 for weights, 1e-5 relative plus 1e-7 absolute for scalar metrics
(`logprob_mismatch` 1e-6 absolute: see test_rl_folded.py). Layouts:

- 2 ranks: CP2 with the ring and with the all-gather KV exchange;
- 4 ranks: CP2·EP2 (the EP all-to-alls pair the two CP ranks, which run the two halves of one micro-batch), CP2·TP2
  (the cut padded to 2·cp·tp, then split over TP by sequence parallelism; vocab-parallel log-probs) and PP2·CP2 (each
  stage's attention bound to the cut's layout inside the pipeline schedules, rl/pipelined.py).

The samples are 9 and 10 tokens long, so micro-batches are padded to 4·k (8·k with TP) and documents straddle the
zigzag chunks: a query sees keys of its document on the other rank. "replay_kl" (one sample per micro-batch, recomputed
old log-probs, truncated importance weights, KL to a reference copied from the parallelized policy, the router's
micro-batch aux loss and z-loss on: the 2-3 padding tokens of each micro-batch must join neither) and "packed"
(several samples per micro-batch) both run. A rank that ran whole micro-batches, or loss sums not summed over CP,
doubles or halves the loss and the metrics; per-token tensors cut by another index than the tokens misalign log-probs
and advantages.
The padding's routed load is kept out of the expert load the bias update reads: equal to one process's exactly.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from services.common.config import Config, ConfigError
from services.trainer.model.loss import IGNORE_INDEX
from services.trainer.parallel.context_parallel import zigzag_index
from services.trainer.parallel.groups import Axis
from services.trainer.rl.cp_sharding import cp_shard
from services.trainer.rl.step import RLMicroBatch, rl_step
from services.trainer.rl.train_rl import validate_rl
from tests.parallel_harness import spawn_ranks
from tests.rl_helpers import micro_batches, single_process_rl_steps
from tests.test_rl_folded import TIMEOUT_S, _config, _model, run_and_compare
from tests.test_rl_parallel import _steps

LAYOUTS = {2: [dict(cp=2, cp_comm="ring"), dict(cp=2, cp_comm="allgather")],
           4: [dict(cp=2, ep=2, cp_comm="ring"), dict(cp=2, tp=2, cp_comm="allgather"),
               dict(cp=2, pp=2, cp_comm="ring")]}


@pytest.fixture(scope="module")
def steps():
    return _steps()


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_context_parallel_rl_steps_match_one_process_metrics_and_published_weights(world, steps, tmp_path):
    run_and_compare(world, LAYOUTS[world], steps, str(tmp_path))


def test_the_cp_cut_takes_every_per_token_tensor_at_the_tokens_index_and_pads_a_separate_ignored_document(steps):
    cp, sp = 2, 2
    packed = [RLMicroBatch.from_data(d) for d in micro_batches(steps[0], max_tokens=40)[0]]
    mb = next(m for m in packed if m.tokens.shape[0] % (2 * cp * sp) and m.cu_seqlens.shape[0] > 2)  # padded, packed
    T = mb.tokens.shape[0]
    total = T + (-T) % (2 * cp * sp)
    cuts = [cp_shard(mb, Axis("cp", None, (0, 1), r), "ring", sp) for r in range(cp)]
    order = torch.cat([zigzag_index(total, cp, r) for r in range(cp)])
    whole = {}
    for name in ("tokens", "position_ids", "targets", "rollout_logp", "advantages", "rewards", "versions"):
        t = torch.empty(total, dtype=getattr(mb, name).dtype)
        t[order] = torch.cat([getattr(c, name) for c in cuts])
        assert torch.equal(t[:T], getattr(mb, name)), name
        whole[name] = t
    routing = torch.empty(mb.routing.shape[0], total, mb.routing.shape[2], dtype=mb.routing.dtype)
    routing[:, order] = torch.cat([c.routing for c in cuts], dim=1)
    assert torch.equal(routing[:, :T], mb.routing)
    assert (whole["targets"][T:] == IGNORE_INDEX).all() and (whole["advantages"][T:] == 0).all()
    # the padding tokens each rank holds are where the cut put them, and form one document of their own
    for r, c in enumerate(cuts):
        held = zigzag_index(total, cp, r)
        assert torch.equal(held[c.padding] if c.padding is not None else held[:0], held[held >= T])
        assert c.cp_layout.doc_ids[T:].unique().numel() == 1 and c.cp_layout.doc_ids[T] > c.cp_layout.doc_ids[T - 1]
        assert int(c.cu_seqlens[-1]) == total // cp


def test_rl_config_accepts_static_context_parallelism_and_refuses_dynamic_cp():
    cfg = Config()
    cfg.rl.enabled, cfg.run.nproc, cfg.parallel.cp = True, 2, 2
    validate_rl(cfg)
    cfg.parallel.cp_sizes = [2]  # the static size only: the same layout
    validate_rl(cfg)
    cfg.parallel.cp_sizes = [1, 2]
    with pytest.raises(ConfigError, match="does not run dynamic context parallel"):
        validate_rl(cfg)


def _load_worker(rank: int, world: int, steps: list[list], out_dir: str) -> None:
    from services.trainer.parallel.expert_parallel import sync_expert_load
    from services.trainer.parallel.groups import init_groups
    from services.trainer.parallel.parallelize import build_optimizer, parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    try:
        cfg = _config(dict(cp=2, cp_comm="ring"), "replay_kl")
        groups = init_groups(cfg)
        model = parallelize(_model(0.0), cfg, groups)
        opt = build_optimizer(model, cfg, groups)
        data = micro_batches(steps[0], max_tokens=cfg.rl.micro_batch_tokens)[0]
        rl_step(model, opt, data, cfg.rl, torch.device("cpu"), cfg.optimizer.clip_grad, version=0, lr=cfg.optimizer.lr,
                cp_comm="ring").read()
        sync_expert_load(model, groups)  # what the bias update reads (train_rl.rl_train_step)
        loads = torch.stack([m.router.tokens_per_expert for m in model.moe_layers()])
        torch.save({"loads": loads}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_the_cp_padding_is_kept_out_of_the_expert_load_the_bias_update_reads(steps, tmp_path):
    """Each replayed micro-batch of one sample (9 or 10 tokens) is padded to 12 for CP2: the routers' summed load is
    one process's exactly (counts), not 2-3 padding tokens per micro-batch more."""
    ranks = spawn_ranks(_load_worker, (2, steps, str(tmp_path)), 2, str(tmp_path), timeout_s=TIMEOUT_S)
    cfg = _config(dict(), "replay_kl")
    model = _model(0.0)
    next(single_process_rl_steps(model, cfg, steps[:1]))
    expected = torch.stack([m.router.tokens_per_expert for m in model.moe_layers()])
    for rank in ranks:
        assert torch.equal(rank["loads"], expected), (rank["loads"], expected)
