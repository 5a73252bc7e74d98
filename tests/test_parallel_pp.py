"""Pipeline parallelism: stage splitting and the 1F1B schedule reproduce the single-process run, MoE aux losses too.

Through the production path (`parallel_harness`): every step's loss, every gradient at full shape and the parameters
after three AdamW steps match within 1e-5 relative L2 (fp32). The aux and z losses are on: each MoE layer attaches its
aux-loss gradient to its output, so it must reach the routers of every stage through the activation gradients that
travel between stages.
"""

from __future__ import annotations

import pytest

from parallel_harness import (assert_bf16_master_parity, assert_parity, make_batches, run_parallel, run_reference,
                              tiny_config)
from services.trainer.parallel.pipeline import stage_layers


def test_even_split_gives_earlier_stages_the_extra_layers():
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(4, 4) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]


def test_configured_split_is_followed_and_a_wrong_one_names_the_setting():
    assert stage_layers(4, 2, [3, 1]) == [range(0, 3), range(3, 4)]
    with pytest.raises(ValueError, match="pp_layers"):
        stage_layers(4, 2, [2, 1])


def test_pp2_1f1b_with_aux_and_z_loss_matches_single_process(tmp_path):
    cfg = tiny_config(pp=2)
    cfg.optimizer.lr = 2e-3  # see test_parallel_tp: keeps Adam's amplification of rounding well under the tolerance
    cfg.model.aux_loss_coeff, cfg.model.z_loss_coeff = 0.1, 0.01
    batches = make_batches(cfg.model, steps=3, micro=4, tokens=32)  # 4 micro-batches: warm-up, steady state, drain
    assert_parity(run_reference(cfg, batches), run_parallel(cfg, batches, world=2, out_dir=str(tmp_path)))


def test_pp2_uneven_split_of_four_layers_matches_single_process(tmp_path):
    cfg = tiny_config(pp=2, pp_layers=[3, 1])
    cfg.optimizer.lr = 2e-3
    cfg.model.num_layers, cfg.model.first_k_dense, cfg.model.aux_loss_coeff = 4, 1, 0.1
    batches = make_batches(cfg.model, steps=3, micro=3, tokens=32, seed=1)
    assert_parity(run_reference(cfg, batches), run_parallel(cfg, batches, world=2, out_dir=str(tmp_path)))


def test_pp2_with_bf16_parameters_and_fp32_master_weights_matches_single_process(tmp_path):
    """`optimizer.param_dtype=bf16` under PP2 1F1B against one process, as the DP2 bf16 test: each stage computes its
    layers' bf16 ops exactly as one process does and sums micro-batch gradients in fp32 in its buckets, so the
    tolerance and its reasons are the DP2 bf16 test's (`assert_bf16_master_parity`).
    Measured: losses equal, gradients 1.3e-7 at steps 1-2 and 1.9e-5 at step 3, norms 6.9e-8, parameters 4.2e-8."""
    cfg = tiny_config(pp=2)
    cfg.optimizer.lr, cfg.optimizer.param_dtype = 2e-3, "bf16"
    cfg.model.aux_loss_coeff, cfg.model.z_loss_coeff = 0.1, 0.01
    batches = make_batches(cfg.model, steps=3, micro=4, tokens=32)
    assert_bf16_master_parity(run_reference(cfg, batches), run_parallel(cfg, batches, world=2, out_dir=str(tmp_path)))
