"""Parallel Folding: the MoE layers' ETP×EP×EDP layout is independent of the attention side's TP×CP×DP (EP may exceed
DP), and every folded layout reproduces one process over all micro-batches: step losses, every gradient, the global
grad norm and the parameters after the steps agree within 1e-5 relative L2 (fp32).

The aux load-balancing loss is on in every layout: under TP (sequence parallel) or CP a rank's router sees a token
shard, and its statistics are summed over the ranks holding the micro-batch (see services/trainer/model/moe/router.py).
One layout runs Qwen2-MoE's extras: q/k/v biases (split over TP with their heads) and a shared expert whose sigmoid gate
reads the rank's token shard (its gradient summed over TP, then over the data-parallel replicas as every dense one's).
"""

from __future__ import annotations

import pytest

from parallel_harness import assert_parity, make_batches, run_parallel, run_reference, tiny_config

QWEN2_MOE = dict(qkv_bias=True, shared_expert_ffn_hidden_size=16, shared_expert_gate=True)
LAYOUTS = [  # (world, parallel, model overrides)
    pytest.param(2, dict(etp=2), {}, id="etp2"),
    pytest.param(4, dict(ep=2, etp=2), {}, id="ep2xetp2-alltoall"),
    pytest.param(4, dict(ep=2, etp=2, dispatcher="allgather"), {}, id="ep2xetp2-allgather"),
    pytest.param(4, dict(tp=2, ep=4), {}, id="ep4-folded-over-dp2xtp2"),
    pytest.param(4, dict(cp=2, ep=2, etp=2), {}, id="cp2-with-ep2xetp2"),
    pytest.param(4, dict(pp=2, ep=2), {}, id="pp2-with-ep2"),
    pytest.param(4, dict(tp=2, ep=4), QWEN2_MOE, id="qwen2_moe-ep4-folded-over-dp2xtp2"),
]


@pytest.mark.parametrize("world,parallel,model", LAYOUTS)
def test_folded_layout_matches_single_process(tmp_path, world, parallel, model):
    cfg = tiny_config(**parallel)
    for key, value in model.items():
        setattr(cfg.model, key, value)
    cfg.optimizer.lr = 2e-3  # see test_parallel_tp: keeps Adam's amplification of rounding well under the tolerance
    batches = make_batches(cfg.model, steps=2, micro=4, seed=5)
    assert_parity(run_reference(cfg, batches), run_parallel(cfg, batches, world=world, out_dir=str(tmp_path)))
