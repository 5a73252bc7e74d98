"""The held-out loss (services/trainer/evaluate.py) under folded layouts against one process, and what it leaves alone.

Each parallel run (gloo, CPU) evaluates the whole evaluation set from its dp shares (micro-batch j on dp rank j % dp,
as the dataloader deals them, each sized for the layout's CP group), trains one step, and evaluates again. The reference
evaluates a fresh model, and trains another fresh model one step *without* evaluating first, then evaluates it: an
evaluation that moved anything a step reads (the routers' load counts, which the aux-loss-free bias update uses; the
MTP sums; train mode) would show in the second loss or in the step's loads. Losses agree to 1e-5 relative (fp32, other
summation orders: TP's vocab-parallel cross-entropy, CP's blockwise attention).
"""

from __future__ import annotations

import math
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from services.trainer.evaluate import EvalResult, evaluate
from services.trainer.model.transformer import MoETransformer
from services.trainer.optim import build_adamw, clip_and_step, set_lr
from services.trainer.parallel.groups import single_process
from services.trainer.step import count_loss_tokens, forward_backward
from services.trainer.train import advance_router_bias
from tests.parallel_harness import make_batches, spawn_ranks, tiny_config

RTOL = 1e-5
SEED = 7
CPU = torch.device("cpu")


def _config(**parallel):
    cfg = tiny_config(**parallel)
    cfg.model.bias_update_rate = 1e-2  # the step's loads move the routers' bias: a polluted count changes the weights
    cfg.model.mtp_num_layers = 1  # the depths' held-out loss too, and sums a polluting evaluation would leave behind
    cfg.model.num_layers = 4 if cfg.parallel.pp_virtual > 1 else 2
    cfg.data.eval_micro_batches = 4
    cfg.data.grad_accum = 2  # (what parallel.ep_overlap asks of a step: two micro-batches per rank, as here)
    return cfg


def _data(cfg):
    held_out = make_batches(cfg.model, steps=1, micro=4, tokens=32, seed=11)[0]
    train = make_batches(cfg.model, steps=1, micro=4, tokens=32, seed=3)[0]
    return held_out, train


def _with_cp_size(mbs, cp):
    return [{**mb, "cp_size": torch.tensor(cp)} for mb in mbs]


def _reference(cfg) -> dict:
    held_out, train = _data(cfg)
    groups = single_process()

    def fresh():
        model = MoETransformer(cfg.model)
        model.init_weights(SEED)
        return model

    first = evaluate(fresh(), _with_cp_size(held_out, 1), groups, cfg, CPU, None)
    model = fresh()
    opt = build_adamw(model, cfg.optimizer)
    set_lr(opt, cfg.optimizer.lr)
    for moe in model.moe_layers():
        moe.aux_loss_scale = 1.0 / len(train)
    forward_backward(model, train, count_loss_tokens(train), CPU, None)
    model.mtp_loss_sums.take(CPU)  # the step's own, as train.py's record takes them
    clip_and_step(opt, model.parameters(), cfg.optimizer.clip_grad)
    loads = advance_router_bias(model, cfg)
    second = evaluate(model, _with_cp_size(held_out, 1), groups, cfg, CPU, None)
    return {"first": first, "second": second, "routed": float(loads.sum())}


def _worker(rank: int, world: int, cfg, out_dir: str) -> None:
    from services.trainer.parallel.expert_parallel import sync_expert_load
    from services.trainer.parallel.groups import init_groups, sum_over
    from services.trainer.parallel.parallelize import build_optimizer, forward_backward_parallel, parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        groups = init_groups(cfg)
        model = MoETransformer(cfg.model)
        model.init_weights(SEED)
        parallelize(model, cfg, groups)
        opt = build_optimizer(model, cfg, groups)
        held_out, train = _data(cfg)
        dp = groups.dp.size
        share = _with_cp_size(held_out[groups.dp.rank::dp], cfg.parallel.cp)
        first = evaluate(model, share, groups, cfg, CPU, None)
        per_rank = len(train) // dp
        mine = train[groups.dp.rank * per_rank:(groups.dp.rank + 1) * per_rank]
        opt.zero_grad()
        forward_backward_parallel(model, mine, groups, cfg, CPU, None, opt)
        opt.finish_grad_sync()
        model.mtp_loss_sums.take(CPU)
        sync_expert_load(model, groups)
        loads = advance_router_bias(model, cfg)
        opt.step(cfg.optimizer.lr)
        opt.wait_params()
        second = evaluate(model, share, groups, cfg, CPU, None)
        # the stage's MoE layers' loads (summed over its replicas), summed over the stages: the whole model's
        routed = float(sum_over(loads.sum().reshape(1).double(), groups.pp)[0])
        torch.save({"first": vars(first), "second": vars(second), "training": model.training, "routed": routed},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


LAYOUTS = {
    "dp2": dict(world=2),
    "tp2": dict(world=2, tp=2),
    "cp2": dict(world=2, cp=2),
    "pp2": dict(world=2, pp=2),
    "pp2_virtual2": dict(world=2, pp=2, pp_virtual=2),
    "ep2": dict(world=2, ep=2),
    "ep2_overlap": dict(world=2, ep=2, ep_overlap=True),
    "cp2_dynamic": dict(world=2, cp=2, cp_sizes=[1, 2]),
    "tp2_ep2_dp2": dict(world=4, tp=2, ep=2),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_held_out_loss_under_a_layout_equals_one_process(name, tmp_path):
    layout = dict(LAYOUTS[name])
    world = layout.pop("world")
    cfg = _config(**layout)
    one = _config()
    one.model = cfg.model  # (4 layers where the layout interleaves chunks)
    ref = _reference(one)
    results = spawn_ranks(_worker, (world, cfg, str(tmp_path)), world, str(tmp_path))
    for r, got in enumerate(results):
        assert got["training"], f"rank {r}: the model was left in eval mode"
        assert got["routed"] == ref["routed"], f"rank {r}: the step routed {got['routed']} rows, reference " \
                                               f"{ref['routed']} (the evaluation's counted too?)"
        for key in ("first", "second"):
            want, have = ref[key], EvalResult(**got[key])
            assert have.tokens == want.tokens, f"rank {r} {key}: {have.tokens} loss tokens, reference {want.tokens}"
            assert abs(have.loss - want.loss) <= RTOL * want.loss, f"rank {r} {key}: loss {have.loss} != {want.loss}"
            assert abs(have.mtp_loss - want.mtp_loss) <= RTOL * want.mtp_loss, \
                f"rank {r} {key}: MTP loss {have.mtp_loss} != {want.mtp_loss}"
    # the step moved the weights the second evaluation read (random tokens: not necessarily down)
    assert abs(ref["first"].loss - ref["second"].loss) > 1e-3 and math.isfinite(ref["first"].loss)


def test_evaluation_leaves_the_training_state_as_it_was():
    """One process: the routers' counts, train mode and every parameter are as before; the loss is the token-weighted
    mean of the micro-batches' summed losses."""
    cfg = _config()
    held_out, train = _data(cfg)
    model = MoETransformer(cfg.model)
    model.init_weights(SEED)
    forward_backward(model, train, count_loss_tokens(train), CPU, None)  # the counts of a step in progress
    counts = [moe.router.tokens_per_expert.clone() for moe in model.moe_layers()]
    assert all(c.sum() > 0 for c in counts)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = evaluate(model, _with_cp_size(held_out, 1), single_process(), cfg, CPU, None)
    assert model.training
    for before, moe in zip(counts, model.moe_layers()):
        assert torch.equal(moe.router.tokens_per_expert, before)
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n
    model.eval()
    with torch.no_grad():
        want = sum(float(model(mb["tokens"], mb["position_ids"], mb["cu_seqlens"], labels=mb["labels"]))
                   for mb in held_out) / count_loss_tokens(held_out)
    assert result.tokens == count_loss_tokens(held_out)
    assert abs(result.loss - want) <= 1e-6 * want
