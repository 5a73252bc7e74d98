"""RL steps under static and dynamic context parallelism reproduce one process on the same trajectories.

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

Dynamic CP (`parallel.cp_sizes`): each micro-batch carries the CP size the dataloader's RL source gives it by the
pre-training budget (`data.cp_max_tokens_per_rank`), and the trainer's CP blocks split a dp rank's micro-batches as in
pre-training (`cp_share`):
- 2 ranks, CP2 with sizes [1, 2] and 9 tokens per rank: in "replay_kl" the 10-token samples run on both ranks, the
  9-token ones on one rank each (half on each), so a rank runs uncut micro-batches right after cut ones (the attention
  cores and routers must drop the previous layout); in "packed" every micro-batch needs both ranks;
- 4 ranks, CP2·EP2 with sizes [1, 2] and 40 tokens per rank (DP2): every "replay_kl" micro-batch runs on one rank,
  while the EP all-to-alls pair the two CP ranks, which now run different micro-batches; in "packed" the replicas get
  micro-batches of size 1 of 40 and 36 tokens, and of 36, 36 and 36 (the plan whose slowest rank, as its CP blocks run
  it, finishes first: rollout_source.plan_step): the second replica's third is left over after equal shares and runs
  on the whole group instead; and
  PP2·CP2 as the 2-rank case, each stage's CP ranks splitting the micro-batches alike inside the pipeline schedules.
`test_dynamic_cp_layouts_give_micro_batches_both_sizes` proves those sizes, and each rank records the CP group size of
every micro-batch it ran (`DYNAMIC_CUTS`): running every micro-batch over the whole group would match one process too.

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
from collections import Counter
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from services.common.config import Config
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

# dynamic CP: the sizes, and the token budget per CP rank that the RL source sizes micro-batches by (data.cp_max_*)
DYNAMIC_CP2 = dict(cp=2, cp_sizes=[1, 2], cp_max_tokens_per_rank=9, cp_comm="ring")
DYNAMIC_CP2_EP2 = dict(cp=2, ep=2, cp_sizes=[1, 2], cp_max_tokens_per_rank=40, cp_comm="allgather")
DYNAMIC_PP2_CP2 = dict(pp=2, **DYNAMIC_CP2)
LAYOUTS = {2: [dict(cp=2, cp_comm="ring"), dict(cp=2, cp_comm="allgather"), DYNAMIC_CP2],
           4: [dict(cp=2, ep=2, cp_comm="ring"), dict(cp=2, tp=2, cp_comm="allgather"),
               dict(cp=2, pp=2, cp_comm="ring"), DYNAMIC_CP2_EP2, DYNAMIC_PP2_CP2]}


@pytest.fixture(scope="module")
def steps():
    return _steps()


# Dynamic CP: the CP group sizes each rank runs its micro-batches on over the two steps (`_sizes` below gives the
# dataloader's sizes). DP1 (CP2, PP2·CP2): per step 4 micro-batches of size 2 on both CP ranks and 16 of size 1 shared
# 8 / 8. DP2 (CP2·EP2): per step and replica 10 of size 1 shared 5 / 5, and in "packed" (ranks 0-1: the first
# replica) two of size 1, one on each CP rank, and (ranks 2-3) three: one on each CP rank and the left-over one on
# both (size 2). A dict: the same on every rank; a list: rank by rank.
DP1_CUTS = {"replay_kl": {1: 16, 2: 8}, "packed": {2: 10}}
DYNAMIC_CUTS = {2: {str(DYNAMIC_CP2): DP1_CUTS},
                4: {str(DYNAMIC_CP2_EP2): {"replay_kl": {1: 10}, "packed": [{1: 2}] * 2 + [{2: 2, 1: 2}] * 2},
                    str(DYNAMIC_PP2_CP2): DP1_CUTS}}


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_context_parallel_rl_steps_match_one_process_metrics_and_published_weights(world, steps, tmp_path):
    ranks = run_and_compare(world, LAYOUTS[world], steps, str(tmp_path))
    for layout, by_scenario in DYNAMIC_CUTS[world].items():  # each micro-batch ran on the CP group of its size
        for scenario, cuts in by_scenario.items():
            expected = cuts if isinstance(cuts, list) else [cuts] * world
            assert [Counter(rank[(layout, scenario)]["cuts"]) for rank in ranks] == expected, (layout, scenario)


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


def _sizes(layout: dict, dp: int, scenario: str, steps: list[list]) -> list[int]:
    """The CP sizes of every micro-batch of every dp rank of every step, as the dynamic `layout` gets them."""
    cfg = _config(layout, scenario)
    return [int(mb["cp_size"]) for groups in steps
            for rank in micro_batches(groups, dp, cfg.rl.micro_batch_tokens, cp_cfg=cfg) for mb in rank]


def test_dynamic_cp_layouts_give_micro_batches_both_sizes(steps):
    """What the dynamic-CP parity cases above run: micro-batches of size 1 and of size 2 in one step (2 ranks), and a
    size-1 micro-batch left over after equal shares (4 ranks, "packed": one per step, in the second replica)."""
    assert Counter(_sizes(DYNAMIC_CP2, 1, "replay_kl", steps)) == {1: 32, 2: 8}  # the 9- and 10-token samples
    assert set(_sizes(DYNAMIC_CP2, 1, "packed", steps)) == {2}
    assert set(_sizes(DYNAMIC_CP2_EP2, 2, "replay_kl", steps)) == {1}
    assert Counter(_sizes(DYNAMIC_CP2_EP2, 2, "packed", steps)) == {1: 10}  # 2 steps x ([40, 36] + [36, 36, 36])


def test_rl_config_accepts_static_and_dynamic_context_parallelism():
    cfg = Config()
    cfg.rl.enabled, cfg.run.nproc, cfg.parallel.cp = True, 2, 2
    validate_rl(cfg)
    cfg.parallel.cp_sizes = [1, 2]
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
