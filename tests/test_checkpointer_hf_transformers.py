"""HF interop against the `transformers` library itself (a test dependency: the `test` extra installs it).

Specification: for Mixtral, Qwen3-MoE and Qwen2-MoE, a random foldmoe model exported with `export_hf` loads in
`AutoModelForCausalLM.from_pretrained` and computes the same logits as foldmoe on the same sequence (fp32, atol 1e-4);
and a random transformers model written by `save_pretrained` (per-expert layout, and transformers 5's fused layout)
imports with `import_hf` into a foldmoe model with the same logits. The tiny models have GQA, head_dim != hidden/heads,
6 experts with top-2 routing, non-default RoPE theta and norm eps, non-unit norm scales (QK-norm included) and, for
Qwen3/Qwen2-MoE, a leading dense layer (Qwen2-MoE also q/k/v biases and a gated shared expert), so a wrong name, layout
or config field shows in the logits. Routing normalisation is
checked both ways: Mixtral renormalises the top-k softmax probabilities (the same as a softmax over the top-k logits),
Qwen3 and Qwen2 do so only with `norm_topk_prob` (run with both settings); each comparison also shows that the other
normalisation would be detected.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from services.checkpointer.hf import export_hf, import_hf
from services.common.config import ModelConfig
from services.trainer.model.transformer import MoETransformer

ATOL = 1e-4
SHAPE = dict(vocab_size=96, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=24, num_experts=6,
             top_k=2, moe_ffn_hidden_size=40, ffn_hidden_size=56, norm_eps=1e-5, rope_theta=5e5, init_std=0.1)
# (family, first_k_dense, norm_topk_prob)
CASES = [("mixtral", 0, True), ("qwen3_moe", 1, True), ("qwen3_moe", 1, False), ("qwen2_moe", 1, False)]
IDS = ["mixtral", "qwen3_moe", "qwen3_moe-no_norm_topk", "qwen2_moe"]
QWEN2_MOE = dict(qkv_bias=True, shared_expert_ffn_hidden_size=48, shared_expert_gate=True)  # ours


def our_config(family: str, first_k_dense: int, norm_topk_prob: bool) -> ModelConfig:
    return ModelConfig(**SHAPE, first_k_dense=first_k_dense, norm_topk_prob=norm_topk_prob,
                       qk_norm=family == "qwen3_moe", **(QWEN2_MOE if family == "qwen2_moe" else {}))


def hf_config(family: str, first_k_dense: int, norm_topk_prob: bool):
    """A transformers config of the same shape, built with transformers' own config classes."""
    common = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=24, num_experts_per_tok=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 5e5}, max_position_embeddings=256)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=6, intermediate_size=40)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**common, num_experts=6, moe_intermediate_size=40, intermediate_size=56,
                                           shared_expert_intermediate_size=48, norm_topk_prob=norm_topk_prob,
                                           mlp_only_layers=list(range(first_k_dense)))
    return transformers.Qwen3MoeConfig(**common, num_experts=6, moe_intermediate_size=40, intermediate_size=56,
                                       mlp_only_layers=list(range(first_k_dense)), norm_topk_prob=norm_topk_prob)


def ours_logits(model: MoETransformer, tokens: torch.Tensor) -> torch.Tensor:
    """One unpacked sequence through foldmoe's packed interface."""
    T = tokens.shape[0]
    with torch.no_grad():
        return model(tokens, torch.arange(T), torch.tensor([0, T], dtype=torch.int32))


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens[None]).logits[0]


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Random everything: norm scales (QK-norm included) around 1, matrices large enough that positions and routing
    show in the logits."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen) if p.ndim == 1 else
                0.1 * torch.randn(p.shape, generator=gen))


def load_hf(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def tokens(n: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


def assert_routing_matters(cfg: ModelConfig, state: dict, reference: torch.Tensor, toks: torch.Tensor) -> None:
    """The same weights with the other top-k normalisation give clearly different logits: the comparison would see a
    routing mismatch between the two libraries."""
    other = MoETransformer(ModelConfig(**{**cfg.__dict__, "norm_topk_prob": not cfg.norm_topk_prob})).eval()
    other.load_state_dict(state)
    assert (ours_logits(other, toks) - reference).abs().max() > 100 * ATOL


@pytest.mark.parametrize("family, first_k_dense, norm_topk_prob", CASES, ids=IDS)
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, family, first_k_dense, norm_topk_prob):
    cfg = our_config(family, first_k_dense, norm_topk_prob)
    ours = MoETransformer(cfg)
    ours.init_weights(seed=5)
    with torch.no_grad():  # non-unit norm scales (init sets them to 1), so every norm's mapping shows in the logits
        gen = torch.Generator().manual_seed(6)
        for name, p in ours.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
    ours.eval()
    sharded = family == "mixtral"  # one case in files of at most 256 KiB, with the index transformers reads
    out = export_hf(ours.state_dict(), cfg, family, tmp_path / "hf", dtype=torch.float32,
                    **({"shard_bytes": 256 << 10} if sharded else {}))
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert (out / "model.safetensors.index.json").is_file() == sharded
    assert len(files) > 1 if sharded else files == ["model.safetensors"]

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family and config["tie_word_embeddings"] is False
    hf = load_hf(out)
    assert type(hf).__name__ == {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                                 "qwen2_moe": "Qwen2MoeForCausalLM"}[family]
    c = hf.config
    assert (c.num_key_value_heads, c.head_dim, c.num_experts_per_tok, c.rms_norm_eps) == (2, 24, 2, 1e-5)
    assert c.rope_parameters["rope_theta"] == 5e5 and c.rope_parameters["rope_type"] == "default"
    if family in ("qwen3_moe", "qwen2_moe"):
        assert (c.norm_topk_prob, c.mlp_only_layers, c.moe_intermediate_size) == (norm_topk_prob, [0], 40)
        assert type(hf.model.layers[0].mlp).__name__.endswith("MoeMLP")  # the dense first layer
    if family == "qwen2_moe":
        assert (c.qkv_bias, c.shared_expert_intermediate_size) == (True, 48)
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in ours.parameters())

    toks = tokens()
    expected = ours_logits(ours, toks)
    assert expected.std() > 0.1  # logits large enough for atol 1e-4 to mean something
    torch.testing.assert_close(hf_logits(hf, toks), expected, rtol=0, atol=ATOL)
    assert_routing_matters(cfg, ours.state_dict(), expected, toks)


@pytest.mark.parametrize("original_format", [True, False], ids=["per_expert", "fused"])
@pytest.mark.parametrize("family, first_k_dense, norm_topk_prob", CASES, ids=IDS)
def test_transformers_checkpoint_imports_with_the_same_logits(tmp_path, family, first_k_dense, norm_topk_prob,
                                                              original_format):
    torch.manual_seed(7)
    hf = AutoModelForCausalLM.from_config(hf_config(family, first_k_dense, norm_topk_prob), dtype=torch.float32,
                                          attn_implementation="eager").eval()
    randomize(hf, seed=8)
    # transformers' own shards (several files and their index) in one layout, one file in the other
    hf.save_pretrained(tmp_path / "hf", save_original_format=original_format,
                       max_shard_size="200KB" if original_format else "1GB")
    files = list((tmp_path / "hf").glob("*.safetensors"))
    assert len(files) > 1 if original_format else len(files) == 1

    state, cfg = import_hf(tmp_path / "hf")
    assert (cfg.qk_norm, cfg.norm_topk_prob, cfg.first_k_dense) == (family == "qwen3_moe", norm_topk_prob,
                                                                   first_k_dense)
    qwen2 = family == "qwen2_moe"
    assert (cfg.qkv_bias, cfg.shared_expert_gate, cfg.shared_expert_ffn_hidden_size) == (qwen2, qwen2, 48 * qwen2)
    assert (cfg.kv_channels, cfg.num_kv_heads, cfg.rope_theta, cfg.norm_eps) == (24, 2, 5e5, 1e-5)
    ours = MoETransformer(cfg).eval()
    ours.load_state_dict(state)  # strict: every parameter and buffer of our model is set

    toks = tokens(seed=1)
    expected = hf_logits(hf, toks)
    assert expected.std() > 0.1
    torch.testing.assert_close(ours_logits(ours, toks), expected, rtol=0, atol=ATOL)
    assert_routing_matters(cfg, state, expected, toks)
