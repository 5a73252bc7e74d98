"""FLOPs accounting: `active_params` is what a token multiplies with, counted from the config."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import ModelConfig, load_config
from services.trainer.metrics import active_params, attention_params, flops_per_token
from services.trainer.model.transformer import MoETransformer
from services.trainer.optim import lr_at
from services.common.config import OptimizerConfig


@pytest.mark.parametrize("overrides", [{}, {"first_k_dense": 1, "shared_expert_ffn_hidden_size": 64, "top_k": 3}])
def test_active_params_equal_the_built_model_with_experts_scaled_by_top_k(overrides):
    cfg = ModelConfig(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, num_experts=8, top_k=2,
                      moe_ffn_hidden_size=32, ffn_hidden_size=96, **{k: v for k, v in overrides.items() if k != "top_k"})
    cfg.top_k = overrides.get("top_k", cfg.top_k)
    model = MoETransformer(cfg)
    count = 0.0
    for name, p in model.named_parameters():
        if p.ndim < 2 or name.startswith("embed."):
            continue  # norm scales and the embedding lookup do no multiply-adds
        count += p.numel() * (cfg.top_k / cfg.num_experts if ".experts." in name else 1)
    assert active_params(cfg) == pytest.approx(count)
    assert flops_per_token(cfg, 128) == pytest.approx(6 * count + 6 * 3 * 4 * 16 * 128)


@pytest.mark.parametrize("q_lora_rank", [0, 16])
def test_mla_active_params_and_attention_flops_by_hand(q_lora_rank):
    cfg = ModelConfig(hidden_size=64, num_layers=3, num_heads=4, num_experts=8, top_k=2, moe_ffn_hidden_size=32,
                      ffn_hidden_size=96, first_k_dense=1, attention="mla", q_lora_rank=q_lora_rank, kv_lora_rank=12,
                      qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    # q: 64·16 + 16·4·(8+4), or 64·4·12; kv_a_proj_with_mqa 64·(12+4); kv_b_proj 12·4·(8+6); o_proj 4·6·64
    q = 64 * 16 + 16 * 48 if q_lora_rank else 64 * 48
    assert attention_params(cfg) == q + 1024 + 672 + 1536
    model = MoETransformer(cfg)
    count = sum(p.numel() * (cfg.top_k / cfg.num_experts if ".experts." in n else 1)
                for n, p in model.named_parameters() if p.ndim >= 2 and not n.startswith("embed."))
    assert active_params(cfg) == pytest.approx(count)
    # per layer and head: the score GEMM over nope + rope = 12 dims, the value GEMM over v_head_dim = 6
    assert flops_per_token(cfg, 128) == pytest.approx(6 * count + 3 * 3 * 4 * (12 + 6) * 128)


def test_mtp_depths_add_their_weights_and_attention_to_the_flops():
    cfg = ModelConfig(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, num_experts=8, top_k=2,
                      moe_ffn_hidden_size=32, ffn_hidden_size=96, mtp_num_layers=2)
    plain = ModelConfig(**{**cfg.__dict__, "mtp_num_layers": 0})
    model = MoETransformer(cfg)
    # every MTP weight (eh_proj, the block, experts by top_k) and the shared output layer, once per depth
    mtp = sum(p.numel() * (cfg.top_k / cfg.num_experts if ".experts." in n else 1)
              for n, p in model.named_parameters() if n.startswith("mtp.") and p.ndim >= 2)
    extra = 6 * (mtp + 2 * 64 * cfg.vocab_size) + 2 * 6 * 4 * 16 * 128
    assert flops_per_token(cfg, 128) - flops_per_token(plain, 128) == pytest.approx(extra)


def test_deepseek_v3_attention_has_its_published_size():
    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "deepseek_v3.yaml").model
    # q_a 7168·1536, q_b 1536·128·192, kv_a 7168·(512+64), kv_b 512·128·(128+128), o 128·128·7168: 187.1M a layer
    assert attention_params(cfg) == 187_105_280
    assert 36e9 < active_params(cfg) + cfg.vocab_size * cfg.hidden_size < 38e9  # "37B activated" with the embedding


def test_learning_rate_warms_up_linearly_then_decays_by_cosine_to_min_lr():
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(0, cfg, 110) == pytest.approx(0.1)
    assert lr_at(9, cfg, 110) == pytest.approx(1.0)
    assert lr_at(60, cfg, 110) == pytest.approx(0.55)
    assert lr_at(110, cfg, 110) == pytest.approx(0.1)


def test_learning_rate_decays_linearly_warmup_stable_decay_or_not_at_all():
    linear = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=10, decay="linear")
    assert [lr_at(s, linear, 110) for s in (9, 10, 60, 110)] == pytest.approx([1.0, 1.0, 0.55, 0.1])
    wsd = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=10, decay="wsd", decay_steps=20)
    assert lr_at(0, wsd, 110) == pytest.approx(0.1)
    assert {lr_at(s, wsd, 110) for s in range(9, 91)} == {1.0}  # stable until the last 20 steps
    assert [lr_at(s, wsd, 110) for s in (95, 100, 110)] == pytest.approx([0.775, 0.55, 0.1])
    default = OptimizerConfig(lr=1.0, min_lr=0.0, warmup_steps=10, decay="wsd")  # the last 20% after warmup
    assert lr_at(89, default, 110) == 1.0 and lr_at(100, default, 110) == pytest.approx(0.5)
    constant = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=10, decay="constant")
    assert {lr_at(s, constant, 110) for s in range(9, 120)} == {1.0}


def test_a_decay_length_is_refused_where_it_cannot_apply():
    from services.common.config import ConfigError

    load_config(None, ["optimizer.decay=wsd", "optimizer.decay_steps=50", "run.steps=100"])
    with pytest.raises(ConfigError, match="set decay=wsd"):
        load_config(None, ["optimizer.decay_steps=50", "run.steps=100"])
    with pytest.raises(ConfigError, match="exceeds the 80 steps after warmup"):
        load_config(None, ["optimizer.decay=wsd", "optimizer.decay_steps=90", "run.steps=100"])
    with pytest.raises(ConfigError, match="not one of"):
        load_config(None, ["optimizer.decay=step"])
