"""HF interop for the model in services/trainer/model: export/import round trip and dense -> MoE upcycling.

Specification: exporting to Mixtral or Qwen3-MoE naming and importing back gives the identical state dict (expert
bias reset to zero, which HF cannot store); configs that the family cannot express are refused with the reason; an
upcycled MoE (every expert a copy of the dense MLP, top-k weights summing to 1) computes the dense model's logits.
(That transformers loads the export and computes the same logits: tests/test_checkpointer_hf_transformers.py.)
"""

from __future__ import annotations

import json

import pytest
import torch

from services.checkpointer.hf import HFError, export_hf, import_hf, upcycle
from services.common.config import ModelConfig
from services.trainer.model.transformer import MoETransformer


def model(cfg: ModelConfig) -> MoETransformer:
    m = MoETransformer(cfg)
    m.init_weights(seed=3)
    return m


@pytest.mark.parametrize("family, first_k_dense", [("mixtral", 0), ("qwen3_moe", 1)])
def test_export_then_import_round_trips_the_state_dict(tmp_path, family, first_k_dense):
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, num_experts=4, top_k=2,
                      moe_ffn_hidden_size=32, ffn_hidden_size=96, first_k_dense=first_k_dense,
                      qk_norm=family == "qwen3_moe")
    state = model(cfg).state_dict()
    out = export_hf(state, cfg, family, tmp_path / "hf", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family
    back, back_cfg = import_hf(out)
    assert (back_cfg.num_experts, back_cfg.top_k, back_cfg.first_k_dense, back_cfg.moe_ffn_hidden_size) == (4, 2,
                                                                                                          first_k_dense, 32)
    assert back_cfg.qk_norm == cfg.qk_norm
    assert sorted(back) == sorted(state)
    for name, t in state.items():
        assert torch.equal(back[name], t), name


def test_families_refuse_what_they_cannot_express():
    cfg = ModelConfig(num_layers=2, first_k_dense=1)
    with pytest.raises(HFError, match="mixtral has no dense layers"):
        export_hf({}, cfg, "mixtral", "/nonexistent")
    with pytest.raises(HFError, match="no shared expert"):
        export_hf({}, ModelConfig(shared_expert_ffn_hidden_size=64), "qwen3_moe", "/nonexistent")
    with pytest.raises(HFError, match="qwen3_moe has per-head q/k RMSNorm.*model.qk_norm=true"):
        export_hf({}, ModelConfig(), "qwen3_moe", "/nonexistent")
    with pytest.raises(HFError, match="mixtral has no per-head q/k RMSNorm.*model.qk_norm=false"):
        export_hf({}, ModelConfig(qk_norm=True), "mixtral", "/nonexistent")
    with pytest.raises(HFError, match="norm_topk_prob=true"):
        export_hf({}, ModelConfig(norm_topk_prob=False), "mixtral", "/nonexistent")
    with pytest.raises(HFError, match="score_func=sigmoid"):
        export_hf({}, ModelConfig(qk_norm=True, score_func="sigmoid"), "qwen3_moe", "/nonexistent")
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_experts=4, moe_ffn_hidden_size=8)
    state = model(cfg).state_dict()
    state["layers.0.mlp.router.expert_bias"][0] = 0.5
    with pytest.raises(HFError, match="expert_bias is not zero"):
        export_hf(state, cfg, "mixtral", "/nonexistent")


def test_upcycled_moe_computes_the_dense_models_logits():
    base = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=48, vocab_size=64)
    dense_cfg = ModelConfig(**base, first_k_dense=2)
    moe_cfg = ModelConfig(**base, first_k_dense=1, num_experts=4, top_k=2, moe_ffn_hidden_size=48,
                          norm_topk_prob=True, aux_loss_coeff=0.0)
    dense = model(dense_cfg)
    moe = MoETransformer(moe_cfg)
    moe.load_state_dict(upcycle(dense.state_dict(), dense_cfg, moe_cfg))
    tokens = torch.randint(0, 64, (12,))
    pos = torch.cat([torch.arange(5), torch.arange(7)])
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    dense.eval(), moe.eval()
    with torch.no_grad():
        torch.testing.assert_close(moe(tokens, pos, cu), dense(tokens, pos, cu), rtol=1e-5, atol=1e-5)
    with pytest.raises(HFError, match="moe_ffn_hidden_size=48"):
        upcycle(dense.state_dict(), dense_cfg, ModelConfig(**base, moe_ffn_hidden_size=32))
