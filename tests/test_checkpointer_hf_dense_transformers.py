"""Dense HF models (Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM, MistralForCausalLM) against the `transformers` library itself,
and sparse upcycling from one.

Specification: a random transformers dense model written by `save_pretrained` imports with `import_hf` into a
foldmoe model (every layer's MLP dense) with the same logits (fp32, atol 1e-4), tied embeddings included; a random
foldmoe dense model exported with `export_hf` loads in `from_pretrained` with the same logits; through the command
line, an imported dense model upcycled to an MoE (every expert a copy of the MLP, top-k weights summing to 1) computes
the transformers model's logits. The tiny models have GQA, head_dim != hidden/heads, non-default RoPE theta and norm
eps and non-unit norm scales (Qwen3's QK-norm included) and biases (Qwen2's q/k/v), so a wrong name, layout or config field shows in the logits.
Llama 3.1's context extension (rope type "llama3") converts both ways with the same logits, its original context short
enough that some frequencies are kept, some interpolated and some blended. A dense family refuses an MoE model and an
MoE family a dense one, naming the fix.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
import yaml

from services.checkpointer.convert import main as convert
from services.checkpointer.hf import HFError, export_hf, import_hf
from services.checkpointer.hf_families import config_from_hf
from services.checkpointer.load import load_checkpoint
from services.common.config import ModelConfig
from services.trainer.model.transformer import MoETransformer
from test_checkpointer_hf_transformers import ATOL, hf_logits, load_hf, ours_logits, randomize, tokens

SHAPE = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=24, intermediate_size=56, rms_norm_eps=1e-5, max_position_embeddings=256,
             rope_parameters={"rope_type": "default", "rope_theta": 5e5})
CONFIGS = {"qwen3": transformers.Qwen3Config, "qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig,
           "mistral": transformers.MistralConfig}


LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # head_dim 24: turns over 64 positions from 10.2 down to 6e-5


def random_hf(family: str, tied: bool, **config):
    torch.manual_seed(3)
    if family == "mistral":
        config.setdefault("sliding_window", None)  # as Mistral-7B v0.2 on; with a window it is refused (below)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[family](**{**SHAPE, **config}, tie_word_embeddings=tied),
                                                       dtype=torch.float32, attn_implementation="eager").eval()
    randomize(hf, seed=4)
    return hf


def assert_rope_scaling_matters(ours: MoETransformer, cfg: ModelConfig, toks: torch.Tensor,
                                expected: torch.Tensor) -> None:
    """The same weights with plain RoPE give clearly different logits: the comparison would see the scaling lost."""
    plain = MoETransformer(ModelConfig(**{**cfg.__dict__, "rope_scaling_factor": 1.0})).eval()
    plain.load_state_dict(ours.state_dict())
    assert (ours_logits(plain, toks) - expected).abs().max() > 100 * ATOL


@pytest.mark.parametrize("family, tied, rope", [("qwen3", True, None), ("qwen2", True, None), ("llama", False, None),
                                               ("llama", False, LLAMA3), ("mistral", False, None)],
                         ids=["qwen3", "qwen2", "llama", "llama3_rope", "mistral"])
def test_a_transformers_dense_model_imports_with_the_same_logits(tmp_path, family, tied, rope):
    hf = random_hf(family, tied, **({"rope_parameters": rope} if rope else {}))
    hf.save_pretrained(tmp_path / "hf")
    state, cfg = import_hf(tmp_path / "hf")
    assert (cfg.first_k_dense, cfg.num_layers, cfg.qk_norm, cfg.ffn_hidden_size) == (3, 3, family == "qwen3", 56)
    assert (cfg.kv_channels, cfg.num_kv_heads, cfg.rope_theta, cfg.norm_eps) == (24, 2, 5e5, 1e-5)
    assert cfg.qkv_bias == (family == "qwen2")
    ours = MoETransformer(cfg).eval()
    ours.load_state_dict(state)  # strict: every parameter and buffer of our model is set
    assert not any("experts" in name for name in state)
    toks = tokens(seed=1)
    expected = hf_logits(hf, toks)
    assert expected.std() > 0.1
    torch.testing.assert_close(ours_logits(ours, toks), expected, rtol=0, atol=ATOL)
    if rope:
        assert (cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_original_max_position) == ("llama3", 8.0, 64)
        assert_rope_scaling_matters(ours, cfg, toks, expected)
    if tied:  # our output layer is its own copy of the embedding
        assert torch.equal(state["output.weight"], state["embed.weight"])
        assert state["output.weight"].data_ptr() != state["embed.weight"].data_ptr()


LLAMA3_OURS = {"rope_scaling": "llama3", "rope_scaling_factor": 8.0, "rope_original_max_position": 64}


@pytest.mark.parametrize("family, rope", [("qwen3", {}), ("qwen2", {}), ("llama", {}), ("llama", LLAMA3_OURS),
                                         ("mistral", {})], ids=["qwen3", "qwen2", "llama", "llama3_rope", "mistral"])
def test_a_dense_model_exports_to_transformers_with_the_same_logits(tmp_path, family, rope):
    cfg = ModelConfig(vocab_size=96, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=24,
                      ffn_hidden_size=56, norm_eps=1e-5, rope_theta=5e5, first_k_dense=3, qk_norm=family == "qwen3",
                      qkv_bias=family == "qwen2", **rope)
    ours = MoETransformer(cfg)
    randomize(ours, seed=6)
    ours.eval()
    out = export_hf(ours.state_dict(), cfg, family, tmp_path / "hf", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family and "num_experts_per_tok" not in config
    hf = load_hf(out)
    assert type(hf).__name__ == CONFIGS[family].__name__.replace("Config", "ForCausalLM")
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in ours.parameters())
    toks = tokens(seed=2)
    expected = ours_logits(ours, toks)
    torch.testing.assert_close(hf_logits(hf, toks), expected, rtol=0, atol=ATOL)
    if rope:
        assert_rope_scaling_matters(ours, cfg, toks, expected)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_an_imported_dense_model_upcycles_to_an_moe_computing_its_logits(tmp_path, capsys, family):
    from test_tokenizer import _write_hf_tokenizer

    hf = random_hf(family, tied=True)
    hf.save_pretrained(tmp_path / "hf")
    _write_hf_tokenizer(tmp_path / "hf" / "tokenizer.json", vocab_size=96)
    assert convert(["import", str(tmp_path / "hf"), str(tmp_path / "dense")]) == 0
    # the message names what a run from it needs: the model section and the model's own tokenizer
    assert f"data.tokenizer={(tmp_path / 'hf' / 'tokenizer.json').resolve()}" in capsys.readouterr().err
    model_yaml = tmp_path / "dense" / "model.yaml"
    assert yaml.safe_load(model_yaml.read_text())["model"]["first_k_dense"] == 3
    assert convert(["upcycle", str(tmp_path / "dense"), str(tmp_path / "moe"), "--config", str(model_yaml),
                    "model.first_k_dense=0", "model.num_experts=4", "model.top_k=2", "model.moe_ffn_hidden_size=56",
                    "model.norm_topk_prob=true"]) == 0
    moe_cfg = ModelConfig(**yaml.safe_load((tmp_path / "moe" / "model.yaml").read_text())["model"])
    assert (moe_cfg.first_k_dense, moe_cfg.num_experts) == (0, 4)
    moe = MoETransformer(moe_cfg).eval()
    with load_checkpoint(next((tmp_path / "moe").glob("step_*")), checksums=True) as c:
        moe.load_state_dict({n.removeprefix("model/"): c.read(n) for n in c.names()})
    toks = tokens(seed=3)
    torch.testing.assert_close(ours_logits(moe, toks), hf_logits(hf, toks), rtol=0, atol=ATOL)


def test_dense_and_moe_families_refuse_each_others_models():
    with pytest.raises(HFError, match=r"qwen3 is a dense model: it needs `model.first_k_dense=model.num_layers` \(2\)"):
        export_hf({}, ModelConfig(num_layers=2, qk_norm=True), "qwen3", "/nonexistent")
    with pytest.raises(HFError, match=r"llama has no per-head q/k RMSNorm: it needs `model.qk_norm=false`"):
        export_hf({}, ModelConfig(num_layers=2, first_k_dense=2, qk_norm=True), "llama", "/nonexistent")
    with pytest.raises(HFError, match=r"qwen2 has q/k/v biases: it needs `model.qkv_bias=true`"):
        export_hf({}, ModelConfig(num_layers=2, first_k_dense=2), "qwen2", "/nonexistent")
    with pytest.raises(HFError, match=r"llama has no q/k/v biases but `model.qkv_bias=true`; export it as qwen2"):
        export_hf({}, ModelConfig(num_layers=2, first_k_dense=2, qkv_bias=True), "llama", "/nonexistent")
    with pytest.raises(HFError, match=r"qwen2_moe has a shared expert with a sigmoid gate"):
        export_hf({}, ModelConfig(num_layers=2, shared_expert_ffn_hidden_size=16), "qwen2_moe", "/nonexistent")
    with pytest.raises(HFError, match=r"qwen3_moe has no shared expert"):
        export_hf({}, ModelConfig(num_layers=2, qk_norm=True, shared_expert_ffn_hidden_size=16,
                                  shared_expert_gate=True), "qwen3_moe", "/nonexistent")
    with pytest.raises(HFError, match="mixtral has no dense layers"):
        export_hf({}, ModelConfig(num_layers=2, first_k_dense=2), "mixtral", "/nonexistent")
    with pytest.raises(HFError, match=r"sliding_window=4096: our attention is full causal"):
        config_from_hf(transformers.MistralConfig(**SHAPE, sliding_window=4096).to_dict())
    llama3 = dict(num_layers=2, first_k_dense=2, qk_norm=True, rope_scaling="llama3", rope_scaling_factor=8.0)
    with pytest.raises(HFError, match=r"qwen3 export writes plain RoPE but `model.rope_scaling_factor=8.0` \(llama3\)"):
        export_hf({}, ModelConfig(**llama3), "qwen3", "/nonexistent")


def test_llama3_frequencies_keep_interpolate_and_blend_by_turns_over_the_original_context():
    from services.trainer.model.rope import rope_frequencies, rotary

    cfg = ModelConfig(rope_theta=5e5, rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_position=64)
    plain, scaled = rope_frequencies(24, 5e5), rotary(24, cfg)
    turns = 64 * plain / (2 * torch.pi)
    assert (turns >= 4).any() and (turns <= 1).any()  # every regime is here
    assert torch.equal(scaled[turns >= 4], plain[turns >= 4])  # kept
    torch.testing.assert_close(scaled[turns <= 1], plain[turns <= 1] / 8)  # interpolated
    mid = (turns > 1) & (turns < 4)
    w = (turns[mid] - 1) / 3
    assert mid.any()
    torch.testing.assert_close(scaled[mid], plain[mid] * w + plain[mid] / 8 * (1 - w))
