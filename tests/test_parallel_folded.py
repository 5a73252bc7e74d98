"""Parallel Folding end to end: attention TP×CP(×PP) and MoE EP(×PP) over the same ranks reproduce one process.

Through the production path (`parallel_harness`): every step's loss, every gradient at full shape and the parameters
after three AdamW steps match within 1e-5 relative L2 (fp32; lr 2e-3, see test_parallel_tp).
"""

from __future__ import annotations

from parallel_harness import assert_parity, make_batches, run_parallel, run_reference, tiny_config


def folded_config(**parallel):
    cfg = tiny_config(**parallel)
    cfg.optimizer.lr = 2e-3
    cfg.model.first_k_dense, cfg.model.shared_expert_ffn_hidden_size = 1, 16
    cfg.model.aux_loss_coeff, cfg.model.z_loss_coeff = 1e-2, 1e-2  # over the SP and CP groups of each micro-batch
    return cfg


def test_tp2_sp_cp2_ring_with_ep4_etp1_matches_single_process(tmp_path):
    """EP spans the TP and CP ranks: each rank's token shard is dispatched to experts on all four ranks."""
    cfg = folded_config(tp=2, cp=2, ep=4)
    batches = make_batches(cfg.model, steps=3, micro=2, tokens=32, seed=3)
    assert_parity(run_reference(cfg, batches), run_parallel(cfg, batches, world=4, out_dir=str(tmp_path)))


def test_pp2_tp2_sp_with_ep2_matches_single_process(tmp_path):
    cfg = folded_config(pp=2, tp=2, ep=2)
    cfg.model.num_layers = 3
    batches = make_batches(cfg.model, steps=3, micro=3, tokens=32, seed=4)
    assert_parity(run_reference(cfg, batches), run_parallel(cfg, batches, world=4, out_dir=str(tmp_path)))
