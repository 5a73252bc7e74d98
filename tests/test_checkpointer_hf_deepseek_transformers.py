"""DeepSeek-V3 and -V2 HF interop against `transformers` itself (DeepseekV3ForCausalLM, DeepseekV2ForCausalLM; a test
dependency).

Specification: a random tiny transformers DeepSeek-V3 (MLA with and without q_lora_rank, rope rows interleaved as
published or not, YaRN with both mscales, 1 dense + 2 MoE layers, 8 experts in 4 groups of which tokens use 2, top-2
sigmoid routing with a nonzero selection bias, a shared expert, routed scaling 2.5) written by `save_pretrained`
(per-expert and fused layouts) imports with `import_hf` into a foldmoe model with the same logits (fp32, atol 1e-4,
over 96 tokens: past YaRN's original 64-token context). Each comparison also shows that the router bias and the rope
row order matter (dropping either moves the logits far beyond the tolerance). A random foldmoe MLA model exported with
`export_hf` loads in `from_pretrained` with the same logits, in fp32 and in bf16 (against our model with the same
bf16-rounded weights; the expert bias stays fp32). Through the command line, a published-style checkpoint (FP8 blocks,
an MTP layer) imports, MTP layer included, and exports back to the HF model of its dequantised weights, with the same
logits and the same MTP tensors. DeepSeek-V2 (softmax scores, greedy top-k, unnormalised scaled weights, two shared
experts, rope rows as complex pairs) both ways with the same logits, and what transformers' V2 would compute otherwise
(a group limit ranked by the best score, renormalisation, sigmoid scores, MTP) refused.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from services.checkpointer.convert import main as convert
from services.checkpointer.hf import export_hf, from_hf, import_hf
from services.checkpointer.load import load_checkpoint
from services.common.config import ModelConfig
from services.trainer.model.transformer import MoETransformer
from test_checkpointer_hf_deepseek import (mtp_layer, random_hf_model, tiny_hf_config, transformers_original_format,
                                           write_fp8_checkpoint)
from test_checkpointer_hf_transformers import hf_logits, load_hf, ours_logits

ATOL = 1e-4
VOCAB, T = 96, 96
# (q_lora_rank, rope_interleave)
CASES = [(32, True), (None, True), (32, False)]
IDS = ["q_lora", "no_q_lora", "q_lora-rope_halves"]


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(seed))


def our_config(q_lora_rank: int) -> ModelConfig:
    """The foldmoe spelling of `tiny_hf_config`."""
    return ModelConfig(vocab_size=VOCAB, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=4, attention="mla",
                       q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                       v_head_dim=16, first_k_dense=1, ffn_hidden_size=56, num_experts=8, top_k=2,
                       moe_ffn_hidden_size=24, shared_expert_ffn_hidden_size=24, score_func="sigmoid",
                       norm_topk_prob=True, num_groups=4, topk_groups=2, routed_scaling_factor=2.5, norm_eps=1e-6,
                       rope_theta=5e4, rope_scaling_factor=4.0, rope_original_max_position=64, rope_beta_fast=16.0,
                       rope_beta_slow=2.0, rope_mscale=0.9, rope_mscale_all_dim=0.7, init_std=0.1)


def our_model(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> MoETransformer:
    model = MoETransformer(cfg).eval()
    model.load_state_dict(state)  # strict: every parameter and buffer of our model is set
    return model


def assert_far(cfg: ModelConfig, state: dict, reference: torch.Tensor, toks: torch.Tensor) -> None:
    """`state` gives `reference`; the same weights without the router bias do not, so the bias mapping is proven."""
    unbiased = {k: torch.zeros_like(v) if k.endswith("expert_bias") else v for k, v in state.items()}
    assert (ours_logits(our_model(cfg, unbiased), toks) - reference).abs().max() > 100 * ATOL


@pytest.mark.parametrize("original_format", [True, False], ids=["per_expert", "fused"])
@pytest.mark.parametrize("q_lora_rank, rope_interleave", CASES, ids=IDS)
def test_transformers_checkpoint_imports_with_the_same_logits(tmp_path, q_lora_rank, rope_interleave,
                                                              original_format):
    hf = random_hf_model(tiny_hf_config(q_lora_rank, rope_interleave=rope_interleave))
    hf.save_pretrained(tmp_path / "hf", save_original_format=original_format)

    state, cfg = import_hf(tmp_path / "hf")
    assert cfg == our_config(q_lora_rank or 0)
    toks = tokens(seed=1)
    expected = hf_logits(hf, toks)
    assert expected.std() > 0.1  # logits large enough for atol 1e-4 to mean something
    torch.testing.assert_close(ours_logits(our_model(cfg, state), toks), expected, rtol=0, atol=ATOL)
    assert_far(cfg, state, expected, toks)
    # the rope rows read in the other order: clearly other logits, so the reordering is what makes them equal
    hf_state = transformers_original_format(hf.state_dict())
    other = from_hf(hf_state, cfg, "deepseek_v3", rope_interleave=not rope_interleave)
    assert (ours_logits(our_model(cfg, other), toks) - expected).abs().max() > 100 * ATOL


def random_ours(cfg: ModelConfig, seed: int = 5) -> MoETransformer:
    """Random weights, norm scales (latent norms included) around 1 and a nonzero expert bias."""
    model = MoETransformer(cfg)
    model.init_weights(seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.ndim == 1:
                t.copy_(0.2 * torch.randn(t.shape, generator=gen) + (0 if name.endswith("expert_bias") else 1))
    return model.eval()


@pytest.mark.parametrize("q_lora_rank", [32, 0], ids=["q_lora", "no_q_lora"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, q_lora_rank):
    cfg = our_config(q_lora_rank)
    ours = random_ours(cfg)
    out = export_hf(ours.state_dict(), cfg, "deepseek_v3", tmp_path / "hf", dtype=torch.float32)
    hf = load_hf(out)
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    c = hf.config
    assert (c.q_lora_rank, c.n_group, c.topk_group, c.n_shared_experts, c.first_k_dense_replace,
            c.rope_interleave) == (q_lora_rank or None, 4, 2, 1, 1, True)
    assert c.rope_parameters["rope_type"] == "yarn" and c.rope_parameters["mscale_all_dim"] == 0.7
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in ours.parameters())

    toks = tokens()
    expected = ours_logits(ours, toks)
    assert expected.std() > 0.1
    torch.testing.assert_close(hf_logits(hf, toks), expected, rtol=0, atol=ATOL)
    assert_far(cfg, ours.state_dict(), expected, toks)


def test_bf16_export_computes_our_models_bf16_weights(tmp_path):
    cfg = our_config(32)
    state = random_ours(cfg).state_dict()
    out = export_hf(state, cfg, "deepseek_v3", tmp_path / "hf", dtype=torch.bfloat16)
    rounded = {k: v if k.endswith("expert_bias") else v.to(torch.bfloat16).float() for k, v in state.items()}
    toks = tokens(seed=2)
    expected = ours_logits(our_model(cfg, rounded), toks)
    torch.testing.assert_close(hf_logits(load_hf(out), toks), expected, rtol=0, atol=ATOL)


def test_cli_imports_an_fp8_checkpoint_with_mtp_layers_and_exports_it_back(tmp_path):
    config = tiny_hf_config()
    state = transformers_original_format(random_hf_model(config).state_dict())
    published = {**config.to_dict(), "num_nextn_predict_layers": 1,
                 "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [16, 16]}}
    dequantised = write_fp8_checkpoint(tmp_path / "fp8", state, published, mtp_layer(state, 3))
    reference = tmp_path / "reference"  # the HF model of the dequantised weights
    reference.mkdir()
    save_file(dequantised, str(reference / "model.safetensors"))
    (reference / "config.json").write_text(json.dumps(config.to_dict()))

    assert convert(["import", str(tmp_path / "fp8"), str(tmp_path / "ours")]) == 0
    model_yaml = (tmp_path / "ours" / "model.yaml").read_text()
    assert "attention: mla" in model_yaml and "mtp_num_layers: 1" in model_yaml
    with load_checkpoint(tmp_path / "ours" / "step_00000000", checksums=True) as c:
        assert {"model/layers.2.attn.kv_b_proj.weight", "model/mtp.0.eh_proj.weight"} <= set(c.names())
    assert convert(["export", str(tmp_path / "ours"), str(tmp_path / "back"), "--family", "deepseek_v3",
                    "--dtype", "float32"]) == 0
    back = load_file(str(tmp_path / "back" / "model.safetensors"))  # the MTP layer travels both ways
    for name in ("eh_proj", "shared_head.norm", "self_attn.kv_b_proj", "mlp.experts.0.down_proj", "embed_tokens"):
        key = f"model.layers.3.{name}.weight"
        assert torch.equal(back[key], dequantised[key]), key

    toks = tokens(seed=3)
    expected = hf_logits(load_hf(reference), toks)
    assert expected.std() > 0.1
    torch.testing.assert_close(hf_logits(load_hf(tmp_path / "back"), toks), expected, rtol=0, atol=ATOL)


def test_exported_mtp_depth_predicts_as_transformers_mtp_layer(tmp_path):
    """Our MTP depth, exported as DeepSeek-V3's `model.layers.3`, computes transformers' `MtpLayer` (enorm of the
    embedding first, hnorm of the main model's normalised output, eh_proj, the decoder layer, the shared head's
    norm) at every position: the same next-next-token logits (fp32)."""
    from transformers.modeling_layers import MtpModel

    cfg = dataclasses.replace(our_config(32), mtp_num_layers=1)
    ours = random_ours(cfg)
    out = export_hf(ours.state_dict(), cfg, "deepseek_v3", tmp_path / "hf", dtype=torch.float32)
    hf = load_hf(out)
    mtp = MtpModel(hf, 1).eval()
    layer = {k.removeprefix("model.layers.3."): v for k, v in load_file(str(out / "model.safetensors")).items()
             if k.startswith("model.layers.3.")}
    experts = [k for k in layer if k.startswith("mlp.experts.")]  # per expert on disk, fused in transformers 5
    per = [{n: layer.pop(f"mlp.experts.{e}.{n}_proj.weight") for n in ("gate", "up", "down")}
           for e in range(len(experts) // 3)]
    layer["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([w["gate"], w["up"]]) for w in per])
    layer["mlp.experts.down_proj"] = torch.stack([w["down"] for w in per])
    own = {"enorm.weight", "hnorm.weight", "eh_proj.weight"}
    mapped = {f"layers.0.{k}" if k in own else f"layers.0.post_norm.weight" if k == "shared_head.norm.weight"
              else f"layers.0.mtp_block.{k}": v for k, v in layer.items()
              if k not in ("embed_tokens.weight", "shared_head.head.weight")}  # shared with the main model
    missing, unexpected = mtp.load_state_dict(mapped, strict=False)
    assert not unexpected and all(k.startswith(("embed_tokens", "shared_head")) for k in missing), missing

    toks = tokens(seed=4)
    with torch.no_grad():
        main = hf.model(input_ids=toks[None]).last_hidden_state  # after the final norm
        hidden = mtp.forward_layer(0, main[:, :-1], torch.arange(1, T)[None], None, input_ids=toks[None, 1:])
        expected = mtp._project_to_logits(hidden)[0]
        seen = {}
        ours.norm.register_forward_hook(lambda _m, _args, h: seen.setdefault("h", h))
        ours_logits(ours, toks)
        cu, segments = torch.tensor([0, T - 1], dtype=torch.int32), torch.zeros(T - 1, dtype=torch.long)
        x, branch = ours.mtp[0](ours.embed(toks[1:]), seen["h"][:-1], torch.arange(T - 1), cu, segments, T - 1)
        got = ours.output(ours.mtp[0].norm(x + branch))
    assert expected.std() > 0.1
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)


# ---------------------------------------------------------------- DeepSeek-V2 (DeepseekV2ForCausalLM)


def tiny_v2_hf_config(q_lora_rank: int | None) -> transformers.DeepseekV2Config:
    """A tiny DeepSeek-V2(-Lite): MLA as above (rope rows as complex pairs, YaRN with both mscales), 1 dense + 2 MoE
    layers, 8 experts, greedy top-2 of softmax scores, unnormalised and scaled by 2.5, 2 shared experts."""
    return transformers.DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        first_k_dense_replace=1, intermediate_size=56, moe_intermediate_size=24, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=2, routed_scaling_factor=2.5, topk_method="greedy",
        norm_topk_prob=False, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "rope_theta": 5e4, "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.9, "mscale_all_dim": 0.7},
        initializer_range=0.1)


def our_v2_config(q_lora_rank: int) -> ModelConfig:
    return dataclasses.replace(our_config(q_lora_rank), score_func="softmax", norm_topk_prob=False, num_groups=0,
                               topk_groups=0, shared_expert_ffn_hidden_size=48)


def assert_v2_routing_matters(cfg: ModelConfig, state: dict, reference: torch.Tensor, toks: torch.Tensor) -> None:
    """The same weights with renormalised top-k weights give clearly different logits: the comparison would see the
    normalisation mismatched."""
    renormalised = dataclasses.replace(cfg, norm_topk_prob=True)
    assert (ours_logits(our_model(renormalised, state), toks) - reference).abs().max() > 100 * ATOL


@pytest.mark.parametrize("original_format", [True, False], ids=["per_expert", "fused"])
@pytest.mark.parametrize("q_lora_rank", [32, None], ids=["q_lora", "no_q_lora"])
def test_a_transformers_deepseek_v2_imports_with_the_same_logits(tmp_path, q_lora_rank, original_format):
    hf = random_hf_model(tiny_v2_hf_config(q_lora_rank))
    hf.save_pretrained(tmp_path / "hf", save_original_format=original_format)
    state, cfg = import_hf(tmp_path / "hf")
    assert cfg == our_v2_config(q_lora_rank or 0)
    assert not state["layers.1.mlp.router.expert_bias"].any()
    toks = tokens(seed=3)
    expected = hf_logits(hf, toks)
    assert expected.std() > 0.1
    torch.testing.assert_close(ours_logits(our_model(cfg, state), toks), expected, rtol=0, atol=ATOL)
    assert_v2_routing_matters(cfg, state, expected, toks)


@pytest.mark.parametrize("q_lora_rank", [32, 0], ids=["q_lora", "no_q_lora"])
def test_a_deepseek_v2_export_loads_in_transformers_with_the_same_logits(tmp_path, q_lora_rank):
    cfg = our_v2_config(q_lora_rank)
    ours = random_ours(cfg)
    with torch.no_grad():
        for name, t in ours.named_buffers():
            if name.endswith("expert_bias"):
                t.zero_()  # V2 has no selection bias (a nonzero one is refused: test_checkpointer_hf.py)
    out = export_hf(ours.state_dict(), cfg, "deepseek_v2", tmp_path / "hf", dtype=torch.float32)
    hf = load_hf(out)
    assert type(hf).__name__ == "DeepseekV2ForCausalLM"
    c = hf.config
    assert (c.q_lora_rank, c.topk_method, c.n_shared_experts, c.first_k_dense_replace, c.routed_scaling_factor) == \
        (q_lora_rank or None, "greedy", 2, 1, 2.5)
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in ours.parameters())
    toks = tokens(seed=4)
    expected = ours_logits(ours, toks)
    assert expected.std() > 0.1
    torch.testing.assert_close(hf_logits(hf, toks), expected, rtol=0, atol=ATOL)
    assert_v2_routing_matters(cfg, ours.state_dict(), expected, toks)


def test_deepseek_v2_refuses_what_transformers_would_compute_otherwise():
    from services.checkpointer.hf import HFError
    from services.checkpointer.hf_families import config_from_hf

    with pytest.raises(HFError, match="topk_method='group_limited_greedy': deepseek_v2 converts with "
                                      "topk_method='greedy' only"):
        config_from_hf({**tiny_v2_hf_config(32).to_dict(), "topk_method": "group_limited_greedy"})
    with pytest.raises(HFError, match="norm_topk_prob=true: transformers' DeepseekV2 ignores it"):
        config_from_hf({**tiny_v2_hf_config(32).to_dict(), "norm_topk_prob": True})
    for bad, message in ((dict(norm_topk_prob=True), "deepseek_v2 never renormalises"),
                         (dict(score_func="sigmoid"), "deepseek_v2 routes with softmax scores"),
                         (dict(num_groups=4, topk_groups=2), "deepseek_v2 converts with greedy top-k routing"),
                         (dict(mtp_num_layers=1), "deepseek_v2 has no multi-token prediction layers")):
        with pytest.raises(HFError, match=message):
            export_hf({}, dataclasses.replace(our_v2_config(32), **bad), "deepseek_v2", "/nonexistent")
