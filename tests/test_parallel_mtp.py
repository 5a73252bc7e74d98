"""Multi-token prediction under data, tensor (with sequence parallelism), expert and pipeline parallelism reproduces
the single process: every step's loss and MTP loss, every gradient at full shape and the parameters after three AdamW
steps within 1e-5 relative L2 (fp32; `parallel_harness`). Under TP the MTP depth's eh_proj and norms are whole on every rank and
read its token shard, so their gradients must be all-reduced over TP; the shifted labels are the micro-batch's, whole
on every TP rank; the depth's MoE block is sharded over EP like the main model's. Under PP the depths sit on the last
stage and their input embeddings, taken on the first, travel with the hidden states (plain and interleaved 1F1B): the
embedding's gradient comes back the same way. Under context parallelism (static, dynamic, and with PP) the shifted
labels are taken from the whole micro-batch before it is cut into zigzag chunks, and the depth's attention runs the
context-parallel core as the main blocks'."""

from __future__ import annotations

import pytest
import torch

from dynamic_cp_harness import run_dynamic_cp
from parallel_harness import assert_parity, make_batches, run_parallel, run_reference, tiny_config


def mtp_config(**parallel):
    cfg = tiny_config(**parallel)
    cfg.optimizer.lr = 2e-3  # see test_parallel_tp: keeps Adam's amplification of rounding well under the tolerance
    cfg.model.mtp_num_layers, cfg.model.z_loss_coeff = 2, 1e-2
    return cfg


@pytest.mark.parametrize("parallel", [dict(), dict(tp=2), dict(ep=2), dict(tp=2, ep=2)],
                         ids=["dp2", "tp2_sp", "dp2_ep2", "tp2_sp_ep2"])
def test_mtp_matches_single_process(tmp_path, parallel):
    cfg = mtp_config(**parallel)
    batches = make_batches(cfg.model, steps=3, micro=2, tokens=32, seed=5)
    assert_parity(run_reference(cfg, batches), run_parallel(cfg, batches, world=2, out_dir=str(tmp_path)))


def test_mtp_with_ep2_micro_batch_pairs_matches_single_process(tmp_path):
    """`parallel.ep_overlap`: the MTP depth's MoE block runs inside a pair's staged forward, its all-to-alls issued
    while the other micro-batch's may be in flight; every EP rank issues them in the same order."""
    cfg = mtp_config(ep=2, ep_overlap=True)
    cfg.data.grad_accum = 2
    batches = make_batches(cfg.model, steps=3, micro=8, tokens=32, seed=6)  # DP2: two pairs per rank
    assert_parity(run_reference(cfg, batches), run_parallel(cfg, batches, world=2, out_dir=str(tmp_path)))


@pytest.mark.parametrize("parallel, world", [(dict(pp=2), 2), (dict(pp=2, pp_virtual=2), 2), (dict(pp=2, tp=2), 4)],
                         ids=["pp2", "pp2_interleaved", "pp2_tp2_sp"])
def test_mtp_on_the_last_pipeline_stage_matches_single_process(tmp_path, parallel, world):
    cfg = mtp_config(**parallel)
    cfg.model.num_layers = 4  # pp2 x 2 virtual chunks of one layer each
    batches = make_batches(cfg.model, steps=3, micro=4, tokens=32, seed=7)
    assert_parity(run_reference(cfg, batches), run_parallel(cfg, batches, world=world, out_dir=str(tmp_path)))


@pytest.mark.parametrize("parallel, world", [(dict(cp=2), 2), (dict(cp=2, cp_comm="allgather"), 2),
                                             (dict(pp=2, cp=2), 4)], ids=["cp2_ring", "cp2_allgather", "pp2_cp2"])
def test_mtp_under_context_parallelism_matches_single_process(tmp_path, parallel, world):
    cfg = mtp_config(**parallel)
    batches = make_batches(cfg.model, steps=3, micro=2, tokens=32, seed=8)
    assert_parity(run_reference(cfg, batches), run_parallel(cfg, batches, world=world, out_dir=str(tmp_path)))


def test_mtp_under_dynamic_context_parallelism_matches_single_process(tmp_path):
    """One micro-batch over all 4 ranks, two over 2 ranks each (test_parallel_cp's two-blocks-share)."""
    cfg = mtp_config(cp=4, cp_sizes=[2, 4])
    batches = make_batches(cfg.model, steps=3, micro=3, tokens=32, seed=2)
    for mbs in batches:
        for mb, size in zip(mbs, (4, 2, 2)):
            mb["cp_size"] = torch.tensor(size)
    assert_parity(run_reference(cfg, batches), run_dynamic_cp(cfg, batches, world=4, out_dir=str(tmp_path)))
