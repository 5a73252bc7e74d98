"""DeepSeek-V3 HF interop, the parts that need no foldmoe model: RoPE row order, FP8 block dequantisation, the
config.json mapping, refusals, and the multi-token-prediction layers.

Specification: reordering q/k rope rows from DeepSeek's interleaved pairs to [evens | odds] makes our rotate-half RoPE
give HF's rotated vectors (in HF's output order) and so the same q.k; re-interleaving undoes it exactly. An FP8 weight
with one fp32 scale per block (edge blocks cut short) dequantises block by block. A DeepSeek-V3 config.json (published
spelling: rope_scaling, scoring_func, quantization_config, MTP layers) maps to our ModelConfig and back to a config
that maps to the same ModelConfig. Configs transformers would compute differently are refused naming the field. An
FP8 checkpoint with MTP layers imports as its dequantised weights, the MTP layer as our MTP depth (its copies of the
embedding and output layer must be the main ones), while any other unused tensor is still refused; an MTP model exports
its depths back to DeepSeek's layout. (Logits against transformers: test_checkpointer_hf_deepseek_transformers.py.)
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from services.checkpointer.hf import HFError, export_hf, from_hf, hf_config, import_hf
from services.checkpointer.hf_deepseek import deinterleave_rope, dequantize_blocks, interleave_rope
from services.checkpointer.hf_families import config_from_hf
from services.common.config import ModelConfig

BLOCK = (16, 16)  # FP8 blocks of the tiny test models (published: 128x128); their widths leave edge blocks


def tiny_hf_config(q_lora_rank: int | None = 32, **over) -> transformers.DeepseekV3Config:
    """A tiny DeepSeek-V3: 1 dense + 2 MoE layers, 8 experts in 4 groups (top-2 groups, top-2 experts), 1 shared
    expert, YaRN with both mscales (neither 1, so each one's role shows), rope interleaved, non-default widths."""
    fields = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                  q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                  first_k_dense_replace=1, intermediate_size=56, moe_intermediate_size=24, n_routed_experts=8,
                  n_group=4, topk_group=2, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5,
                  norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=256,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 5e4, "factor": 4.0,
                                   "original_max_position_embeddings": 64, "beta_fast": 16.0, "beta_slow": 2.0,
                                   "mscale": 0.9, "mscale_all_dim": 0.7},
                  initializer_range=0.1)
    return transformers.DeepseekV3Config(**{**fields, **over})


def random_hf_model(config: transformers.DeepseekV3Config, seed: int = 8):
    """A transformers DeepseekV3ForCausalLM with every tensor random: norm scales around 1, router biases nonzero
    (large enough to change which experts are picked), weights ~0.1."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                t.copy_(0.2 * torch.randn(t.shape, generator=gen))
            elif name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                t.copy_(1 + 0.3 * torch.randn(t.shape, generator=gen))
            elif t.is_floating_point() and "inv_freq" not in name:
                t.copy_(0.1 * torch.randn(t.shape, generator=gen))
    return model


# ---------------------------------------------------------------- RoPE row order


def rotate_half_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Ours: dim i rotates with dim i + d/2 by angles[i]."""
    half = x.shape[-1] // 2
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([x[..., :half] * cos - x[..., half:] * sin, x[..., half:] * cos + x[..., :half] * sin], -1)


def interleaved_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """DeepSeek's (their reference code's complex form): the pair (x_2i, x_2i+1) rotates by angles[i]."""
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angles.double()), angles.double())).flatten(-2)


def test_rope_rows_reordered_give_deepseeks_rotation_and_reorder_back_exactly():
    heads, nope, rope, hidden, T = 3, 4, 8, 16, 5
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(heads * (nope + rope), hidden, generator=gen, dtype=torch.float64)  # q_b_proj: per head [nope|rope]
    ours = deinterleave_rope(w, heads, rope)
    assert torch.equal(interleave_rope(ours, heads, rope), w)
    assert torch.equal(ours.view(heads, -1, hidden)[:, :nope], w.view(heads, -1, hidden)[:, :nope])  # nope rows stay
    x = torch.randn(T, hidden, generator=gen, dtype=torch.float64)
    angles = torch.arange(T, dtype=torch.float64)[:, None, None] * torch.rand(rope // 2, generator=gen,
                                                                             dtype=torch.float64)
    q_hf = interleaved_rope((x @ w.T).view(T, heads, -1)[..., nope:], angles)
    q_ours = rotate_half_rope((x @ ours.T).view(T, heads, -1)[..., nope:], angles)
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])  # HF's output order: evens | odds
    torch.testing.assert_close(q_ours, q_hf[..., order], rtol=0, atol=1e-12)
    k_hf, k_ours = q_hf.flip(0), q_ours.flip(0)  # any key of the same layout: the dot products agree
    torch.testing.assert_close(q_ours @ k_ours.transpose(-1, -2), q_hf @ k_hf.transpose(-1, -2), rtol=0, atol=1e-10)


def test_kv_a_rope_rows_are_the_last_ones_of_one_head():
    latent, rope = 6, 4
    w = torch.arange((latent + rope) * 2, dtype=torch.float32).view(latent + rope, 2)
    ours = deinterleave_rope(w, 1, rope)
    assert ours[:, 0].tolist() == [0, 2, 4, 6, 8, 10, 12, 16, 14, 18]  # latent rows, then rope rows 0, 2 | 1, 3


# ---------------------------------------------------------------- FP8 blocks


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's recipe, block by block: scale = amax / 448 (e4m3's largest value), fp8 = w / scale."""
    (rows, cols), (br, bc) = w.shape, block
    scale = torch.empty(math.ceil(rows / br), math.ceil(cols / bc))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            scale[i, j] = part.abs().max().clamp_min(1e-12) / 448
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (part / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_by_loop(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    out, (br, bc) = q.float(), block
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * br:(i + 1) * br, j * bc:(j + 1) * bc] *= scale[i, j]
    return out


@pytest.mark.parametrize("shape", [(256, 128), (300, 200), (5, 130)])
def test_fp8_block_dequantisation_scales_each_block_edges_included(shape):
    gen = torch.Generator().manual_seed(1)
    # blocks of very different magnitudes: a scale applied to the wrong block shows
    magnitude = 10.0 ** torch.randint(-3, 3, (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)), generator=gen)
    w = torch.randn(shape, generator=gen) * magnitude.repeat_interleave(128, 0)[:shape[0]].repeat_interleave(128, 1)[
        :, :shape[1]]
    q, scale = quantize_blocks(w, (128, 128))
    got = dequantize_blocks(q, scale, (128, 128), torch.float32)
    torch.testing.assert_close(got, dequantize_by_loop(q, scale, (128, 128)), rtol=0, atol=0)
    # e4m3 keeps 3 mantissa bits (2^-4 relative), down to subnormals 2^-9 apart (times the block's scale)
    step = scale.repeat_interleave(128, 0)[:shape[0]].repeat_interleave(128, 1)[:, :shape[1]] * 2.0 ** -9
    assert bool(((got - w).abs() <= w.abs() / 16 + step).all())
    assert dequantize_blocks(q, scale, (128, 128), torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"needs \[\d+, \d+\] scales"):
        dequantize_blocks(q, scale[1:], (128, 128), torch.float32)


# ---------------------------------------------------------------- config.json


def published_config() -> dict:
    """DeepSeek-V3's config.json as published (transformers 4 spelling, FP8, one MTP layer), shrunk."""
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
            "aux_loss_alpha": 0.001, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 64,
            "initializer_range": 0.02, "intermediate_size": 56, "kv_lora_rank": 16, "max_position_embeddings": 256,
            "moe_intermediate_size": 24, "moe_layer_freq": 1, "n_group": 4, "n_routed_experts": 8,
            "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 4, "num_experts_per_tok": 2,
            "num_hidden_layers": 3, "num_key_value_heads": 4, "num_nextn_predict_layers": 1, "q_lora_rank": 32,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "rms_norm_eps": 1e-6,
            "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "weight_block_size": list(BLOCK)},
            "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 4, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 64, "type": "yarn"},
            "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
            "tie_word_embeddings": False, "topk_group": 2, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
            "v_head_dim": 16, "vocab_size": 96}


def test_published_config_maps_to_ours_and_back():
    cfg, family = config_from_hf(published_config())
    assert family == "deepseek_v3"
    assert (cfg.attention, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
            cfg.v_head_dim, cfg.num_heads, cfg.num_kv_heads) == ("mla", 32, 16, 16, 8, 16, 4, 4)
    assert (cfg.first_k_dense, cfg.ffn_hidden_size, cfg.num_experts, cfg.top_k, cfg.moe_ffn_hidden_size,
            cfg.shared_expert_ffn_hidden_size) == (1, 56, 8, 2, 24, 24)
    assert (cfg.score_func, cfg.norm_topk_prob, cfg.num_groups, cfg.topk_groups, cfg.routed_scaling_factor) == (
        "sigmoid", True, 4, 2, 2.5)
    assert (cfg.rope_theta, cfg.rope_scaling_factor, cfg.rope_original_max_position, cfg.rope_beta_fast,
            cfg.rope_beta_slow, cfg.rope_mscale, cfg.rope_mscale_all_dim) == (10000, 4.0, 64, 32.0, 1.0, 1.0, 1.0)
    assert (cfg.norm_eps, cfg.aux_loss_type, cfg.aux_loss_coeff, cfg.qk_norm) == (1e-6, "sequence", 0.001, False)
    assert cfg.mtp_num_layers == 1

    written = hf_config(cfg, "deepseek_v3", "float32")
    assert config_from_hf(written) == (cfg, "deepseek_v3")
    assert written["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 10000, "factor": 4.0,
                                          "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                          "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert (written["max_position_embeddings"], written["n_shared_experts"], written["n_group"],
            written["topk_group"], written["rope_interleave"], written["num_nextn_predict_layers"]) == (
        256, 1, 4, 2, True, 1)
    loaded = transformers.DeepseekV3Config.from_dict(written)  # transformers reads it as written
    assert (loaded.q_lora_rank, loaded.n_routed_experts, loaded.rope_parameters["rope_type"]) == (32, 8, "yarn")


def test_config_without_groups_yarn_or_q_lora_maps_both_ways():
    no_yarn = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name.startswith("rope_")
               and f.name != "rope_theta"}  # YaRN's other fields mean nothing with it off: theirs are not written
    cfg = dataclasses.replace(config_from_hf(published_config())[0], num_groups=0, topk_groups=0, q_lora_rank=0,
                              shared_expert_ffn_hidden_size=48, **no_yarn)
    written = hf_config(cfg, "deepseek_v3")
    assert (written["n_group"], written["topk_group"], written["q_lora_rank"], written["n_shared_experts"]) == (
        1, 1, None, 2)  # one group holding all experts: no limit
    assert written["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000}
    assert config_from_hf(written) == (cfg, "deepseek_v3")


def test_transformers_defaults_for_missing_yarn_fields_and_mscales():
    config = published_config()
    config["rope_scaling"] = {"type": "yarn", "factor": None, "original_max_position_embeddings": 32}
    cfg, _ = config_from_hf(config)
    # factor: the context ratio 256 / 32; betas 32 / 1; a missing mscale is 0 ("unused") on our side
    assert (cfg.rope_scaling_factor, cfg.rope_beta_fast, cfg.rope_beta_slow, cfg.rope_mscale,
            cfg.rope_mscale_all_dim) == (8.0, 32.0, 1.0, 0.0, 0.0)


REFUSED_IMPORTS = [
    ({"scoring_func": "softmax"}, r"scoring_func='softmax': deepseek_v3 converts with scoring_func='sigmoid'"),
    ({"topk_method": "greedy"}, r"topk_method='greedy'"),
    ({"moe_layer_freq": 2}, r"moe_layer_freq=2"),
    ({"n_shared_experts": 0}, r"n_shared_experts=0"),
    ({"rms_norm_eps": 1e-5}, r"rms_norm_eps=1e-05: .*latent norms .* keep eps 1e-06"),
    ({"attention_bias": True}, r"attention_bias=true"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"RoPE type 'dynamic': deepseek_v3 converts with plain "
                                                            r"RoPE \(rope_type 'default'\) or 'yarn'"),
    ({"rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 64,
                       "attention_factor": 1.5}}, r"attention_factor=1.5"),
    ({"rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 64, "truncate": False}},
     r"truncate=false"),
]


@pytest.mark.parametrize("change, message", REFUSED_IMPORTS, ids=[next(iter(c)) + str(i)
                                                                  for i, (c, _) in enumerate(REFUSED_IMPORTS)])
def test_configs_transformers_computes_otherwise_are_refused_on_import(change, message):
    with pytest.raises(HFError, match=message):
        config_from_hf({**published_config(), **change})


def test_models_deepseek_v3_cannot_express_are_refused_on_export():
    cfg = config_from_hf(published_config())[0]
    for change, message in [
        ({"attention": "gqa", "q_lora_rank": 0, "kv_lora_rank": 0, "qk_nope_head_dim": 0, "qk_rope_head_dim": 0,
          "v_head_dim": 0}, r"needs `model.attention=mla`, got gqa"),
        ({"score_func": "softmax"}, r"routes with sigmoid scores but `model.score_func=softmax`"),
        ({"shared_expert_ffn_hidden_size": 0}, r"positive multiple of `model.moe_ffn_hidden_size=24`, got 0"),
        ({"shared_expert_ffn_hidden_size": 36}, r"got 36"),
        ({"num_groups": 8, "topk_groups": 2}, r"fewer than 2 of `model.num_experts=8` per group"),
        ({"norm_eps": 1e-5}, r"always use eps 1e-06, ours use `model.norm_eps=1e-05`"),
        ({"capacity_factor": 1.25}, r"dropless"),
    ]:
        with pytest.raises(HFError, match=message):
            hf_config(dataclasses.replace(cfg, **change), "deepseek_v3")
    for family in ("mixtral", "qwen3_moe"):  # MLA and YaRN are DeepSeek-V3's
        with pytest.raises(HFError, match=rf"{family} has grouped-query attention but `model.attention=mla`"):
            hf_config(cfg, family)
        with pytest.raises(HFError, match=r"writes plain RoPE but `model.rope_scaling_factor=2.0`"):
            hf_config(ModelConfig(qk_norm=family == "qwen3_moe", rope_scaling_factor=2.0), family)
    with pytest.raises(HFError, match=r"RoPE type 'yarn': qwen3_moe converts with plain RoPE \(rope_type 'default'\)$"):
        config_from_hf({**hf_config(ModelConfig(qk_norm=True), "qwen3_moe"),
                        "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})


# ---------------------------------------------------------------- import: FP8 and MTP layers


def write_fp8_checkpoint(hf_dir, state: dict[str, torch.Tensor], config: dict, mtp: dict[str, torch.Tensor]) -> dict:
    """`state` + `mtp` as a published-style FP8 checkpoint in two shards (linear weights in FP8 blocks with
    their scales; embeddings, norms, router and lm_head as they are); returns the dequantised state."""
    stored, expected = {}, {}
    for name, t in {**state, **mtp}.items():
        quantised = t.ndim == 2 and ("proj" in name or "experts" in name)
        if quantised:
            stored[name], stored[name + "_scale_inv"] = quantize_blocks(t, BLOCK)
            expected[name] = dequantize_by_loop(stored[name], stored[name + "_scale_inv"], BLOCK)
        else:
            stored[name] = expected[name] = t.contiguous()
    hf_dir.mkdir()
    names = sorted(stored)
    save_file({k: stored[k] for k in names[::2]}, str(hf_dir / "model-00001-of-00002.safetensors"))
    save_file({k: stored[k] for k in names[1::2]}, str(hf_dir / "model-00002-of-00002.safetensors"))
    (hf_dir / "config.json").write_text(json.dumps(config))
    return expected


def mtp_layer(state: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """An MTP module as DeepSeek-V3 stores it: a decoder layer (a copy of the last one) plus its own projections."""
    last = f"model.layers.{layer - 1}."
    out = {f"model.layers.{layer}." + k[len(last):]: t.clone() for k, t in state.items() if k.startswith(last)}
    h = state["model.norm.weight"].shape[0]
    return {**out, f"model.layers.{layer}.eh_proj.weight": torch.randn(h, 2 * h),
            f"model.layers.{layer}.enorm.weight": torch.ones(h), f"model.layers.{layer}.hnorm.weight": torch.ones(h),
            f"model.layers.{layer}.shared_head.norm.weight": torch.ones(h),
            # the embedding and output layer it shares, stored again as the published checkpoint does
            f"model.layers.{layer}.embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
            f"model.layers.{layer}.shared_head.head.weight": state["lm_head.weight"].clone()}


def test_fp8_checkpoint_with_mtp_layers_imports_as_its_dequantised_weights(tmp_path):
    config = tiny_hf_config()
    state = transformers_original_format(random_hf_model(config).state_dict())
    hf_dir = tmp_path / "fp8"
    published = {**published_config(), "rope_scaling": None, "rope_parameters": config.rope_parameters}
    mtp = mtp_layer(state, 3)
    expected = write_fp8_checkpoint(hf_dir, state, published, mtp)

    got, cfg = import_hf(hf_dir)
    assert cfg.mtp_num_layers == 1
    want = from_hf(expected, cfg, "deepseek_v3")
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    # the MTP layer as our depth 0: its decoder layer under mtp.0.block, its own weights beside it
    assert torch.equal(got["mtp.0.eh_proj.weight"], expected["model.layers.3.eh_proj.weight"])
    assert torch.equal(got["mtp.0.norm.weight"], expected["model.layers.3.shared_head.norm.weight"])
    assert torch.equal(got["mtp.0.block.mlp.router.weight"], expected["model.layers.3.mlp.gate.weight"])
    assert not any(name.startswith("layers.3.") for name in got)

    copied = tmp_path / "copied"  # an MTP layer whose embedding copy is not the main one's is refused
    write_fp8_checkpoint(copied, state, published,
                         {**mtp, "model.layers.3.embed_tokens.weight": torch.randn_like(state["model.embed_tokens.weight"])})
    with pytest.raises(HFError, match=r"model\.layers\.3\.embed_tokens\.weight differs from the main model's"):
        import_hf(copied)
    bias = got["layers.1.mlp.router.expert_bias"]
    assert bias.dtype == torch.float32 and torch.equal(bias, state["model.layers.1.mlp.gate.e_score_correction_bias"])

    extra = tmp_path / "extra"  # an unused tensor that is not an MTP layer's is still refused
    write_fp8_checkpoint(extra, state, published,
                         {**mtp_layer(state, 3), "model.layers.4.input_layernorm.weight": torch.ones(64)})
    with pytest.raises(HFError, match=r"1 tensors a deepseek_v3 model of this config does not use .*model.layers.4"):
        import_hf(extra)


def transformers_original_format(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's in-memory state (fused experts) -> the published checkpoints' (per-expert; no rotary
    buffers)."""
    out = {}
    for name, t in state.items():
        if "inv_freq" in name:
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            pre, f = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"], out[f"{pre}{e}.up_proj.weight"] = t[e, :f], t[e, f:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name.removesuffix('down_proj')}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def test_fp8_scales_without_a_block_size_or_other_quantisation_are_refused(tmp_path):
    config = published_config()
    w = torch.randn(24, 40)
    q, scale = quantize_blocks(w, BLOCK)
    for name, change, tensors, message in [
        ("noblock", {"quantization_config": None}, {"x.weight": q, "x.weight_scale_inv": scale},
         r"x.weight_scale_inv: block scales but config.json has no quantization_config"),
        ("gptq", {"quantization_config": {"quant_method": "gptq", "bits": 4}}, {"x.weight": w},
         r"only FP8 with per-block weight scales"),
        ("noscale", {}, {"x.weight": q}, r"\['x.weight'\] are FP8 without a weight_scale_inv"),
        ("badscale", {}, {"x.weight": q, "x.weight_scale_inv": scale[:1]}, r"x.weight: weight \[24, 40\] in 16x16 "
                                                                            r"blocks needs \[2, 3\] scales, got \[1, 3\]"),
    ]:
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(HFError, match=message):
            import_hf(tmp_path / name)


def test_expert_bias_exports_in_fp32_whatever_the_dtype(tmp_path):
    """The bias decides which experts are picked: rounding it to bf16 would change the exported model's routing."""
    cfg = dataclasses.replace(config_from_hf(published_config())[0], mtp_num_layers=0)  # transformers saves none
    state = from_hf(transformers_original_format(random_hf_model(tiny_hf_config()).state_dict()), cfg, "deepseek_v3")
    out = export_hf(state, cfg, "deepseek_v3", tmp_path / "bf16", dtype=torch.bfloat16)
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].equal(state["layers.1.mlp.router.expert_bias"])
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
