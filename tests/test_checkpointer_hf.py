"""HF interop for the model in services/trainer/model: export/import round trip and dense -> MoE upcycling.

Specification: exporting to Mixtral or Qwen3-MoE naming and importing back gives the identical state dict (expert
bias reset to zero, which HF cannot store), in one file or in shards with their index; configs that the family cannot
express are refused with the reason; import and export read and convert a layer at a time (an import's shapes pass
reads nothing); an upcycled MoE (every expert a copy of the dense MLP, top-k weights summing to 1) computes the dense
model's logits.
(That transformers loads the export and computes the same logits: tests/test_checkpointer_hf_transformers.py.)
"""

from __future__ import annotations

import json

import pytest
import torch

from services.checkpointer import hf
from services.checkpointer.hf import HFError, export_hf, import_hf, open_hf, to_hf_pieces, upcycle, upcycle_pieces
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


def tiny(family: str = "qwen3_moe") -> ModelConfig:
    return ModelConfig(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, num_experts=4, top_k=2,
                       moe_ffn_hidden_size=32, vocab_size=128, qk_norm=family == "qwen3_moe")


def test_a_sharded_export_maps_every_tensor_once_and_imports_back_exactly(tmp_path):
    cfg = tiny()
    state = model(cfg).state_dict()
    out = export_hf(state, cfg, "qwen3_moe", tmp_path / "hf", dtype=torch.float32, shard_bytes=64 << 10)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 3
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert sorted(set(index["weight_map"].values())) == files
    # HF's total_size: the tensors' bytes (qwen3_moe stores no expert bias)
    assert index["metadata"]["total_size"] == sum(t.nbytes for k, t in state.items() if "expert_bias" not in k)
    assert not list(out.glob(".*"))  # no temporary file left
    for f in files:
        assert (out / f).stat().st_size < (64 << 10) + (16 << 10)  # a shard's tensors, its header and no more
    back, _ = import_hf(out)
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], t) for k, t in state.items())

    (out / "consolidated.safetensors").write_bytes(b"other weights")  # as Mistral's repositories hold: not indexed
    assert sorted(import_hf(out)[0]) == sorted(state)
    (out / files[1]).unlink()  # an incomplete download
    with pytest.raises(HFError, match=rf"lacks 1 of the {len(files)} files its model.safetensors.index.json names "
                                      rf"\(e.g. {files[1]}\): an incomplete download"):
        import_hf(out)
    (out / "consolidated.safetensors").unlink()

    export_hf(state, cfg, "qwen3_moe", out, dtype=torch.float32)  # again, in one file: the shards go
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_import_reads_a_layer_at_a_time_and_its_shapes_pass_reads_nothing(tmp_path, monkeypatch):
    cfg = tiny()
    out = export_hf(model(cfg).state_dict(), cfg, "qwen3_moe", tmp_path / "hf", dtype=torch.float32)
    reads: list[str] = []
    read = hf.HFTensors._read
    monkeypatch.setattr(hf.HFTensors, "_read", lambda self, key: reads.append(key) or read(self, key))
    opened = open_hf(out)
    shapes = opened.shapes()
    assert reads == [] and shapes == {k: tuple(t.shape) for k, t in model(cfg).state_dict().items()}
    pieces = opened.state()
    assert sorted(next(pieces)) == ["embed.weight", "norm.weight", "output.weight"]
    assert sorted(reads) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    for i in range(cfg.num_layers):
        reads.clear()
        piece = next(pieces)
        assert reads and all(k.startswith(f"model.layers.{i}.") for k in reads)  # this layer's, nothing else
        assert all(k.startswith(f"layers.{i}.") for k in piece)
    assert next(pieces, None) is None


class Recording(dict):
    """A state dict that records the names read from it."""

    def __init__(self, state: dict[str, torch.Tensor]):
        super().__init__(state)
        self.reads: list[str] = []

    def __getitem__(self, name: str) -> torch.Tensor:
        self.reads.append(name)
        return super().__getitem__(name)


def test_export_reads_a_layer_at_a_time():
    cfg = tiny()
    state = Recording(model(cfg).state_dict())
    pieces = to_hf_pieces(state, cfg, "qwen3_moe")
    assert sorted(next(pieces)) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    biases = [f"layers.{i}.mlp.router.expert_bias" for i in range(cfg.num_layers)]  # checked before any piece
    assert sorted(state.reads) == sorted(biases + ["embed.weight", "norm.weight", "output.weight"])
    for i in range(cfg.num_layers):
        state.reads.clear()
        assert all(k.startswith(f"model.layers.{i}.") for k in next(pieces))
        assert state.reads and all(k.startswith(f"layers.{i}.") for k in state.reads)
    assert next(pieces, None) is None


def test_an_expert_of_another_shape_is_refused_naming_it(tmp_path):
    cfg = tiny()
    out = export_hf(model(cfg).state_dict(), cfg, "qwen3_moe", tmp_path / "hf", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 16}))
    with pytest.raises(HFError, match=r"model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight is \[32, 64\], where a "
                                      r"qwen3_moe model of this config has \[16, 64\]"):
        open_hf(out).shapes()


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

    state = Recording(dense.state_dict())  # read a layer at a time
    pieces = upcycle_pieces(state, dense_cfg, moe_cfg)
    assert sorted(next(pieces)) == sorted(state.reads) == ["embed.weight", "norm.weight", "output.weight"]
    for i in range(moe_cfg.num_layers):
        state.reads.clear()
        piece = next(pieces)
        assert state.reads and all(k.startswith(f"layers.{i}.") for k in state.reads + list(piece))
        assert (f"layers.{i}.mlp.experts.w13" in piece) == (i >= moe_cfg.first_k_dense)
    assert next(pieces, None) is None
