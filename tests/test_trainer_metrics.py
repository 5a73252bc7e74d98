"""FLOPs accounting: `active_params` is what a token multiplies with, counted from the config."""

from __future__ import annotations

import pytest

from services.common.config import ModelConfig
from services.trainer.metrics import active_params, flops_per_token
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


def test_learning_rate_warms_up_linearly_then_decays_by_cosine_to_min_lr():
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(0, cfg, 110) == pytest.approx(0.1)
    assert lr_at(9, cfg, 110) == pytest.approx(1.0)
    assert lr_at(60, cfg, 110) == pytest.approx(0.55)
    assert lr_at(110, cfg, 110) == pytest.approx(0.1)
