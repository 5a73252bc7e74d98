"""`parallel.ep_overlap`: micro-batches in interleaved pairs (services/trainer/parallel/micro_batch_pairs.py) train
exactly like one process running them one at a time: every step's loss, every gradient and the parameters after three
AdamW steps within the harness's 1e-5 relative L2 (fp32), with the aux and z-losses on and a shared expert.
"""

from __future__ import annotations

import pytest

from parallel_harness import assert_parity, make_batches, run_parallel, run_reference, tiny_config
from services.common.config import ConfigError, load_config


def paired_config(**parallel):
    cfg = tiny_config(ep_overlap=True, **parallel)
    cfg.data.grad_accum = 2  # what validation asks of a run with pairs (the harness passes micro-batches itself)
    cfg.optimizer.lr = 2e-3
    cfg.model.first_k_dense, cfg.model.shared_expert_ffn_hidden_size = 1, 16
    cfg.model.num_layers = 3
    cfg.model.aux_loss_coeff, cfg.model.z_loss_coeff = 1e-2, 1e-2
    return cfg


@pytest.mark.parametrize("micro", [4, 3], ids=["two_pairs", "pair_and_odd_one"])
def test_ep2_pairs_match_single_process(tmp_path, micro):
    cfg = paired_config(ep=2)
    batches = make_batches(cfg.model, steps=3, micro=2 * micro, tokens=32, seed=11)  # DP2: `micro` per rank
    assert_parity(run_reference(cfg, batches), run_parallel(cfg, batches, world=2, out_dir=str(tmp_path)))


@pytest.mark.parametrize("micro", [4, 3], ids=["two_pairs", "pair_and_odd_one"])
def test_pp2_with_ep2_pairs_as_1f1b_units_match_single_process(tmp_path, micro):
    """Under pipeline parallelism the 1F1B schedule moves pairs as units (one backward per pair on every stage)."""
    cfg = paired_config(pp=2, ep=2)
    batches = make_batches(cfg.model, steps=2, micro=2 * micro, tokens=32, seed=15)  # DP2: `micro` per rank
    assert_parity(run_reference(cfg, batches), run_parallel(cfg, batches, world=4, out_dir=str(tmp_path)))


def test_pairs_with_the_memory_policies_they_allow_match_single_process(tmp_path):
    """Recompute of the attention core, the experts' gate/up output and activation, and offload of attention act
    inside modules the paused forward calls plainly, so they work under pairs (the reference applies the same
    policy)."""
    cfg = paired_config(ep=2)
    cfg.model.recompute, cfg.model.offload = ["attn_core", "moe_fc1", "moe_act"], ["attn"]
    batches = make_batches(cfg.model, steps=2, micro=4, tokens=32, seed=14)
    assert_parity(run_reference(cfg, batches), run_parallel(cfg, batches, world=2, out_dir=str(tmp_path)))


def test_tp2_sp_folded_with_ep2_pairs_match_single_process(tmp_path):
    """EP over the TP ranks: each rank dispatches its sequence shard of both micro-batches."""
    cfg = paired_config(tp=2, ep=2)
    batches = make_batches(cfg.model, steps=3, micro=2, tokens=32, seed=12)
    assert_parity(run_reference(cfg, batches), run_parallel(cfg, batches, world=2, out_dir=str(tmp_path)))


def test_cp2_ring_with_ep2_pairs_match_single_process(tmp_path):
    """Context-parallel attention reads each micro-batch's layout from the module: rebound at every switch."""
    cfg = paired_config(cp=2, ep=2)
    batches = make_batches(cfg.model, steps=3, micro=2, tokens=32, seed=13)
    assert_parity(run_reference(cfg, batches), run_parallel(cfg, batches, world=2, out_dir=str(tmp_path)))


@pytest.mark.parametrize("override, cause", [
    (["parallel.ep=1"], "needs `parallel.ep` > 1"),
    (["data.grad_accum=1"], r"`data.grad_accum` >= 2 micro-batches per step \(got 1\)"),
    (["model.recompute=[moe]"], "recompute 'moe'"),
    (["model.recompute=[norm]"], "recompute 'norm'"),
    (["model.offload=[layer]"], "offload 'layer'"),
])
def test_pairs_refuse_what_would_bypass_them(override, cause):
    with pytest.raises(ConfigError, match=cause):
        load_config(None, ["parallel.ep_overlap=true", "parallel.ep=2", "data.grad_accum=2", *override])
