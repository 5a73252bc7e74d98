"""Pipeline parallelism: stage splitting and the 1F1B schedule reproduce the single-process run, MoE aux losses too.

Through the production path (`parallel_harness`): every step's loss, every gradient at full shape and the parameters
after three AdamW steps match within 1e-5 relative L2 (fp32). The aux and z losses are on: each MoE layer attaches its
aux-loss gradient to its output, so it must reach the routers of every stage through the activation gradients that
travel between stages.
"""

from __future__ import annotations

import itertools
import random

import pytest

from parallel_harness import (assert_bf16_master_parity, assert_parity, make_batches, run_parallel, run_reference,
                              tiny_config)
from services.common.config import load_config
from services.trainer.model.transformer import MoETransformer
from services.trainer.parallel.pipeline import keep_stage, stage_layers
from services.trainer.parallel.pipeline_split import balanced_counts, even_counts


def test_even_split_gives_earlier_stages_the_extra_layers():
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(4, 4) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]


def test_configured_split_is_followed_and_a_wrong_one_names_the_setting():
    assert stage_layers(4, 2, [3, 1]) == [range(0, 3), range(3, 4)]
    with pytest.raises(ValueError, match="pp_layers"):
        stage_layers(4, 2, [2, 1])


def _chunk_costs(counts, costs, tail):
    ends = list(itertools.accumulate(counts))
    out = [sum(costs[e - n:e]) for n, e in zip(counts, ends)]
    out[-1] += tail
    return out


def test_balanced_split_minimises_the_costliest_chunk_then_evens_the_rest():
    """Against every split of up to 9 layers into up to 4 chunks, on random costs with and without a tail."""
    rng = random.Random(0)
    for _ in range(60):
        n, chunks = rng.randint(1, 9), rng.randint(1, 4)
        if chunks > n:
            continue
        costs, tail = [rng.choice([1.0, 2.0, 3.5]) for _ in range(n)], rng.choice([0.0, 2.0, 7.0])
        splits = [c for c in itertools.product(range(1, n + 1), repeat=chunks) if sum(c) == n]
        score = lambda c: (max(_chunk_costs(c, costs, tail)), sum(x * x for x in _chunk_costs(c, costs, tail)))
        got = balanced_counts(costs, chunks, tail)
        assert sum(got) == n and min(got) >= 1
        assert score(got) == min(score(c) for c in splits), (costs, tail, got)


def test_balanced_split_of_equal_layers_without_a_tail_is_the_even_split():
    for n in range(1, 12):
        for chunks in range(1, n + 1):
            assert balanced_counts([1.0] * n, chunks) == even_counts(n, chunks)


def test_default_split_counts_the_output_layer_on_the_last_stage():
    # Qwen3-30B-A3B's output layer (2048 x 151936) is ~4 of its MoE blocks' FLOPs per token: the last stage takes
    # fewer blocks (on two H100s, [3, 1] ran 7.8% faster than the even [2, 2]: bench/RESULTS.md)
    cfg = load_config("configs/qwen3_30b_a3b.yaml", ["model.num_layers=4"]).model
    assert stage_layers(4, 2, model_cfg=cfg, seq_len=4096) == [range(0, 3), range(3, 4)]
    cfg = load_config("configs/qwen3_30b_a3b.yaml").model  # all 48 layers
    assert stage_layers(48, 4, model_cfg=cfg, seq_len=4096) == [range(0, 13), range(13, 26), range(26, 39),
                                                                 range(39, 48)]
    assert stage_layers(48, 2, [24, 24], model_cfg=cfg, seq_len=4096) == [range(0, 24), range(24, 48)]  # pp_layers


def test_default_split_counts_the_mtp_depths_on_the_last_stage_too():
    cfg = load_config("configs/deepseek_v3.yaml").model  # 61 layers, one MTP depth
    with_mtp = stage_layers(61, 4, model_cfg=cfg, seq_len=4096)
    cfg.mtp_num_layers = 0
    without = stage_layers(61, 4, model_cfg=cfg, seq_len=4096)
    assert len(with_mtp[-1]) < len(without[-1])


def test_keep_stage_holds_the_cost_balanced_layers():
    cfg = load_config("configs/tiny.yaml", ["model.num_layers=4", "model.vocab_size=65536"]).model
    first, last = (keep_stage(MoETransformer(cfg), 2, rank, seq_len=64) for rank in (0, 1))
    assert sorted(first.layers.keys()) == ["0", "1", "2"] and first.output is None
    assert sorted(last.layers.keys()) == ["3"] and last.embed is None


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
