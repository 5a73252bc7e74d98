"""Multi-head Latent Attention under every parallelism reproduces the single-process run, and its checkpoints reshard.

Through the production path (`parallel_harness`: parallelize -> DistributedOptimizer -> forward_backward_parallel):
every step's loss, every parameter's gradient reassembled to full shape and the parameters after three AdamW steps
match the single process within 1e-5 relative L2 (fp32; lr 2e-3, see test_parallel_tp). YaRN is on throughout (with
DeepSeek's softmax-scale correction), q_lora_rank > 0 and = 0 both run.

Under TP the heads are split (q_proj / q_b_proj and kv_b_proj by output rows, o_proj by input rows) while the latent
projections and norms (q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm) stay whole and feed only the rank's
heads: without the TP all-reduce of their gradients, those gradients would be half of the reference's. Under CP the
ring carries keys and values of different head dims (nope + rope against v_head_dim).

Checkpoints: a TP2 layout reads a one-process checkpoint into its shards, and one process reads back what TP2 saved
(parameters and Adam moments), exactly: the sharding of every MLA parameter is known to the checkpoint boxes.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from parallel_harness import (assert_parity, make_batches, run_parallel, run_reference, save_step_one, spawn_ranks,
                              tiny_config, trained_one_step, _gather_full)
from services.checkpointer.load import load_checkpoint
from services.trainer.model.transformer import MoETransformer
from services.trainer.parallel.checkpoint_shards import load_shards, optimizer_shards, training_shards
from services.trainer.parallel.distributed_optimizer import DistributedOptimizer
from services.trainer.parallel.groups import single_process

MLA = dict(attention="mla", kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
           rope_scaling_factor=4.0, rope_original_max_position=16, rope_mscale=1.0, rope_mscale_all_dim=1.0)


def mla_config(q_lora_rank: int = 16, **parallel):
    cfg = tiny_config(**parallel)
    cfg.optimizer.lr = 2e-3
    for k, v in dict(MLA, q_lora_rank=q_lora_rank, first_k_dense=1, shared_expert_ffn_hidden_size=16,
                     aux_loss_coeff=1e-2, z_loss_coeff=1e-2).items():
        setattr(cfg.model, k, v)
    return cfg


def test_mla_tp2_with_sequence_parallel_matches_single_process(tmp_path):
    cfg = mla_config(tp=2)
    batches = make_batches(cfg.model, steps=3, micro=2, tokens=32)
    assert_parity(run_reference(cfg, batches), run_parallel(cfg, batches, world=2, out_dir=str(tmp_path)))


def test_mla_tp2_without_sequence_parallel_matches_single_process_on_a_dense_model(tmp_path):
    cfg = mla_config(q_lora_rank=0, tp=2, sequence_parallel=False)
    cfg.model.first_k_dense = cfg.model.num_layers  # MoE layers need sequence parallelism under TP
    batches = make_batches(cfg.model, steps=3, micro=2, tokens=32, seed=1)
    assert_parity(run_reference(cfg, batches), run_parallel(cfg, batches, world=2, out_dir=str(tmp_path)))


@pytest.mark.parametrize("cp_comm", ["ring", "allgather"])
def test_mla_cp2_matches_single_process(tmp_path, cp_comm):
    cfg = mla_config(q_lora_rank=0, cp=2, cp_comm=cp_comm)
    batches = make_batches(cfg.model, steps=3, micro=2, tokens=32, seed=2)
    assert_parity(run_reference(cfg, batches), run_parallel(cfg, batches, world=2, out_dir=str(tmp_path)))


def test_mla_pp2_matches_single_process(tmp_path):
    cfg = mla_config(pp=2)
    batches = make_batches(cfg.model, steps=3, micro=4, tokens=32, seed=3)
    assert_parity(run_reference(cfg, batches), run_parallel(cfg, batches, world=2, out_dir=str(tmp_path)))


def test_mla_tp2_sp_folded_with_ep2_matches_single_process(tmp_path):
    """Attention split over heads on the same two ranks that split the experts."""
    cfg = mla_config(tp=2, ep=2)
    batches = make_batches(cfg.model, steps=3, micro=2, tokens=32, seed=4)
    assert_parity(run_reference(cfg, batches), run_parallel(cfg, batches, world=2, out_dir=str(tmp_path)))


# ---------------------------------------------------------------- checkpoint resharding between TP1 and TP2


def _reshard_worker(rank: int, world: int, out_dir: str) -> None:
    from services.trainer.parallel.groups import init_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        cfg = mla_config(tp=2)
        groups = init_groups(cfg)
        # Read the one-process checkpoint into fresh TP2 shards: each rank's box of every parameter.
        fresh, fresh_opt = trained_one_step(cfg, groups, seed=11)
        with load_checkpoint(os.path.join(out_dir, "tp1", "step_00000001")) as ckpt:
            load_shards(ckpt, fresh, fresh_opt, groups)
        loaded = {n: _gather_full(n, p.detach(), p, groups) for n, p in fresh.named_parameters()}
        # Save this layout's own state for the one process to read.
        model, opt = trained_one_step(cfg, groups, seed=5)
        save_step_one(os.path.join(out_dir, "tp2"), rank, world, training_shards(model, opt, groups))
        full = {n: _gather_full(n, p.detach(), p, groups) for n, p in model.named_parameters()}
        split = {n: getattr(p, "tensor_parallel_dim", None) for n, p in model.named_parameters()}
        torch.save({"loaded": loaded, "full": full, "split": split}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_mla_checkpoints_reshard_between_tp1_and_tp2(tmp_path):
    cfg = mla_config()
    one = single_process(cfg)
    model, opt = trained_one_step(cfg, one, seed=3)
    save_step_one(str(tmp_path / "tp1"), 0, 1, training_shards(model, opt, one))

    ranks = spawn_ranks(_reshard_worker, (2, str(tmp_path)), 2, str(tmp_path), timeout_s=180)
    attn = {n.split("attn.", 1)[1]: d for n, d in ranks[0]["split"].items() if ".attn." in n and n.startswith("layers.0")}
    assert attn == {"q_a_proj.weight": None, "q_a_layernorm.weight": None, "q_b_proj.weight": 0,
                    "kv_a_proj_with_mqa.weight": None, "kv_a_layernorm.weight": None, "kv_b_proj.weight": 0,
                    "o_proj.weight": 1}
    for name, p in model.named_parameters():
        assert torch.equal(ranks[0]["loaded"][name], p.detach()), f"TP2 read {name} wrongly from the TP1 checkpoint"

    fresh = MoETransformer(cfg.model)
    fresh.init_weights(99)
    fresh_opt = DistributedOptimizer(fresh, one, cfg.optimizer, bucket_mb=0.01)
    with load_checkpoint(tmp_path / "tp2" / "step_00000001") as ckpt:
        load_shards(ckpt, fresh, fresh_opt, one)
        for name, p in fresh.named_parameters():
            assert torch.equal(p.detach(), ranks[0]["full"][name]), f"TP1 read {name} wrongly from the TP2 checkpoint"
        for name, shard in optimizer_shards(fresh_opt, one).items():
            assert torch.equal(shard.tensor, ckpt.read(name).reshape(shard.tensor.shape)), name
