"""Which models each Hugging Face family can express, and its config.json <-> our ModelConfig, both ways.

Used by services/checkpointer/hf.py (the weights); the rule is the same: a config the family would compute differently
is refused with `HFError`, naming the field and the value it needs. The dense families (Qwen3ForCausalLM,
Qwen2ForCausalLM, LlamaForCausalLM, MistralForCausalLM) are our model with every layer's MLP dense (`model.first_k_dense=num_layers`):
imported to be upcycled into an MoE (convert.py `upcycle`), or exported after dense training.
"""

from __future__ import annotations

from typing import Literal

from services.checkpointer.hf_deepseek import LATENT_NORM_EPS
from services.common.config import ModelConfig

Family = Literal["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "deepseek_v2", "qwen3", "qwen2", "llama",
                 "mistral"]
FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "deepseek_v2", "qwen3", "qwen2", "llama", "mistral")
DEEPSEEK = ("deepseek_v3", "deepseek_v2")  # MLA, shared experts (services/checkpointer/hf_deepseek.py)
DENSE = ("qwen3", "qwen2", "llama", "mistral")  # dense models (every layer's MLP dense: model.first_k_dense=num_layers)
_ARCH = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
         "deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
_QK_NORM = ("qwen3_moe", "qwen3")  # the families with per-head q/k RMSNorm
_QKV_BIAS = ("qwen2_moe", "qwen2")  # the families with q/k/v biases (Qwen2-MoE: unless its config's qkv_bias=false)
_ROPE_SCALING = {"deepseek_v3": "yarn", "deepseek_v2": "yarn", "llama": "llama3"}  # the context extension each family has (model.rope_scaling)
_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0}  # transformers' values for a missing (or null) field


class HFError(ValueError):
    """A model or HF checkpoint that cannot be converted; the message says what does not fit."""


def check_family(cfg: ModelConfig, family: str) -> None:
    """Refuse a config whose model the HF family would compute differently."""
    if family not in FAMILIES:
        raise HFError(f"unknown HF family {family!r}; choose one of {', '.join(FAMILIES)}")
    if family in DENSE:
        if cfg.first_k_dense != cfg.num_layers:
            raise HFError(f"{family} is a dense model: it needs `model.first_k_dense=model.num_layers` "
                          f"({cfg.num_layers}), got {cfg.first_k_dense}; export MoE models as mixtral, qwen3_moe, "
                          "qwen2_moe, deepseek_v3 or deepseek_v2")
    elif cfg.capacity_factor > 0:
        raise HFError(f"{family} is dropless but `model.capacity_factor={cfg.capacity_factor}` drops tokens")
    if family in DEEPSEEK:
        _check_deepseek(cfg, family)
        _check_rope(cfg, family)
        return
    if cfg.attention != "gqa":
        raise HFError(f"{family} has grouped-query attention but `model.attention={cfg.attention}`; export MLA "
                      "models as deepseek_v3 or deepseek_v2")
    _check_rope(cfg, family)
    moe = family not in DENSE
    if family == "qwen2_moe" and not (cfg.shared_expert_ffn_hidden_size and cfg.shared_expert_gate):
        raise HFError("qwen2_moe has a shared expert with a sigmoid gate: it needs `model.shared_expert_ffn_hidden_size`"
                      f" > 0 (got {cfg.shared_expert_ffn_hidden_size}) and `model.shared_expert_gate=true` (got "
                      f"{str(cfg.shared_expert_gate).lower()})")
    if moe and family != "qwen2_moe" and cfg.shared_expert_ffn_hidden_size:
        raise HFError(f"{family} has no shared expert but `model.shared_expert_ffn_hidden_size="
                      f"{cfg.shared_expert_ffn_hidden_size}`")
    if family == "qwen2" and not cfg.qkv_bias:  # (Qwen2-MoE's config says whether it has them)
        raise HFError("qwen2 has q/k/v biases: it needs `model.qkv_bias=true`; export a model without them as llama")
    if cfg.qkv_bias and family not in _QKV_BIAS:
        raise HFError(f"{family} has no q/k/v biases but `model.qkv_bias=true`; export it as "
                      f"{'qwen2' if family in DENSE else 'qwen2_moe'}")
    if family == "mixtral" and cfg.first_k_dense:
        raise HFError(f"mixtral has no dense layers but `model.first_k_dense={cfg.first_k_dense}`")
    if cfg.qk_norm != (family in _QK_NORM):
        raise HFError(f"{family} {'has' if family in _QK_NORM else 'has no'} per-head q/k RMSNorm: it needs "
                      f"`model.qk_norm={str(family in _QK_NORM).lower()}`, got {str(cfg.qk_norm).lower()}")
    if moe and cfg.score_func != "softmax":
        raise HFError(f"{family} routes with softmax scores but `model.score_func={cfg.score_func}`")
    if moe and cfg.num_groups:
        raise HFError(f"{family} has no group-limited routing but `model.num_groups={cfg.num_groups}`")
    if moe and cfg.routed_scaling_factor != 1.0:
        raise HFError(f"{family} does not scale routed outputs but `model.routed_scaling_factor="
                      f"{cfg.routed_scaling_factor}`")
    if family == "mixtral" and not cfg.norm_topk_prob:
        raise HFError("mixtral always renormalises its top-k probabilities (softmax over the top-k logits): it needs "
                      "`model.norm_topk_prob=true`")
    if cfg.mtp_num_layers:
        raise HFError(f"{family} has no multi-token prediction layers but `model.mtp_num_layers={cfg.mtp_num_layers}`; "
                      "export MTP models as deepseek_v3")


def _check_rope(cfg: ModelConfig, family: str) -> None:
    scaling = _ROPE_SCALING.get(family)  # the context extension the family can express, beside plain RoPE
    if cfg.rope_scaling_factor != 1.0 and cfg.rope_scaling != scaling:
        raise HFError(f"{family} export writes plain RoPE{f' or {scaling}' if scaling else ''} but "
                      f"`model.rope_scaling_factor={cfg.rope_scaling_factor}` ({cfg.rope_scaling})")


def _check_deepseek(cfg: ModelConfig, family: str) -> None:
    """What DeepseekV3ForCausalLM computes: MLA, sigmoid scores, shared experts in units of one expert's width; and
    DeepseekV2ForCausalLM: the same with softmax scores, unnormalised top-k weights, no group limit (transformers'
    "greedy"; V2's own group limit ranks groups by their best score, ours by the two best), no selection bias and no
    multi-token prediction."""
    if cfg.attention != "mla":
        raise HFError(f"{family} has Multi-head Latent Attention: it needs `model.attention=mla`, got "
                      f"{cfg.attention}")
    scores = "sigmoid" if family == "deepseek_v3" else "softmax"
    if cfg.score_func != scores:
        raise HFError(f"{family} routes with {scores} scores but `model.score_func={cfg.score_func}`")
    if family == "deepseek_v2":
        if cfg.norm_topk_prob:
            raise HFError("deepseek_v2 never renormalises its top-k probabilities (transformers' DeepseekV2 ignores "
                          "norm_topk_prob): it needs `model.norm_topk_prob=false`")
        if cfg.num_groups:
            raise HFError(f"deepseek_v2 converts with greedy top-k routing: `model.num_groups={cfg.num_groups}` ranks "
                          "groups by their two best scores (DeepSeek-V3), V2's group_limited_greedy by the best one")
        if cfg.mtp_num_layers:
            raise HFError(f"deepseek_v2 has no multi-token prediction layers but `model.mtp_num_layers="
                          f"{cfg.mtp_num_layers}`; export MTP models as deepseek_v3")
    shared, f = cfg.shared_expert_ffn_hidden_size, cfg.moe_ffn_hidden_size
    if shared <= 0 or shared % f:
        raise HFError(f"{family}'s shared experts are n_shared_experts >= 1 experts' width: it needs "
                      f"`model.shared_expert_ffn_hidden_size` a positive multiple of `model.moe_ffn_hidden_size={f}`, "
                      f"got {shared}")
    if cfg.num_groups and cfg.num_experts // cfg.num_groups < 2:
        raise HFError(f"deepseek_v3 ranks expert groups by their two best scores: `model.num_groups="
                      f"{cfg.num_groups}` leaves fewer than 2 of `model.num_experts={cfg.num_experts}` per group")
    if cfg.shared_expert_gate:
        raise HFError(f"{family}'s shared experts are not gated but `model.shared_expert_gate=true`")
    if cfg.norm_eps != LATENT_NORM_EPS:
        raise HFError(f"{family}'s MLA latent norms (q_a_layernorm, kv_a_layernorm) always use eps "
                      f"{LATENT_NORM_EPS}, ours use `model.norm_eps={cfg.norm_eps}`: it needs "
                      f"`model.norm_eps={LATENT_NORM_EPS}`")


def hf_config(cfg: ModelConfig, family: Family, dtype: str = "bfloat16", max_positions: int = 4096) -> dict:
    """config.json for transformers: every field that decides what the HF model computes is written explicitly, so the
    model does not depend on a transformers version's defaults."""
    check_family(cfg, family)
    common = {"architectures": [_ARCH[family]], "model_type": family,
              "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
              "num_attention_heads": cfg.num_heads, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps,
              "tie_word_embeddings": False, "hidden_act": "silu",
              "max_position_embeddings": max_positions, "torch_dtype": dtype, "dtype": dtype,
              "initializer_range": cfg.init_std, "attention_dropout": 0.0, "use_cache": True}
    if family not in DENSE:
        common.update({"num_experts_per_tok": cfg.top_k, "output_router_logits": False})
    if family in DEEPSEEK:
        return {**common, **_deepseek_hf_config(cfg, family, max_positions)}
    common.update({"num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.kv_channels, "sliding_window": None,
                   # transformers < 5 reads rope_theta, 5 reads rope_parameters (and still accepts rope_theta alone)
                   "rope_theta": cfg.rope_theta,
                   "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                   "attention_bias": False})
    if cfg.rope_scaling_factor != 1.0:  # llama3 (check_family refuses the others)
        scaling = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
                   "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
                   "original_max_position_embeddings": cfg.rope_original_max_position}
        common.update(rope_parameters={**scaling, "rope_theta": cfg.rope_theta}, rope_scaling=scaling)
    if family in DENSE:
        return {**common, "intermediate_size": cfg.ffn_hidden_size,
                **{"llama": {"mlp_bias": False}, "qwen3": {"use_sliding_window": False}}.get(family, {})}
    common["router_aux_loss_coef"] = cfg.aux_loss_coeff if cfg.aux_loss_type != "none" else 0.0
    if family == "mixtral":  # always renormalises the top-k probabilities: no norm_topk_prob field
        return {**common, "intermediate_size": cfg.moe_ffn_hidden_size, "num_local_experts": cfg.num_experts,
                "router_jitter_noise": 0.0}
    if family == "qwen2_moe":
        common.update(qkv_bias=cfg.qkv_bias, shared_expert_intermediate_size=cfg.shared_expert_ffn_hidden_size)
    return {**common, "intermediate_size": cfg.ffn_hidden_size, "moe_intermediate_size": cfg.moe_ffn_hidden_size,
            "num_experts": cfg.num_experts, "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(cfg.first_k_dense)), "use_sliding_window": False}


def _deepseek_hf_config(cfg: ModelConfig, family: str, max_positions: int) -> dict:
    """DeepseekV3Config's or DeepseekV2Config's fields (the published spelling: scoring_func, topk_method,
    aux_loss_alpha are what DeepSeek's own code reads; transformers computes the same without them)."""
    rope: dict = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling_factor != 1.0:
        rope.update(rope_type="yarn", factor=cfg.rope_scaling_factor,
                    original_max_position_embeddings=cfg.rope_original_max_position, beta_fast=cfg.rope_beta_fast,
                    beta_slow=cfg.rope_beta_slow, mscale=cfg.rope_mscale, mscale_all_dim=cfg.rope_mscale_all_dim)
        # transformers warns unless max_position_embeddings is the extended context, original x factor
        max_positions = round(cfg.rope_original_max_position * cfg.rope_scaling_factor)
    groups = cfg.num_groups or 1  # one group holding every expert: the group limit selects them all
    if family == "deepseek_v2":  # greedy top-k of softmax scores; its rope rows are always interleaved pairs
        routing = {"scoring_func": "softmax", "topk_method": "greedy"}
    else:  # rope rows as interleaved pairs: the published layout, which DeepSeek's own code and vLLM assume
        routing = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "rope_interleave": True,
                   "num_nextn_predict_layers": cfg.mtp_num_layers}
    return {"max_position_embeddings": max_positions, "attention_bias": False, "rope_theta": cfg.rope_theta,
            "rope_parameters": rope, **routing,
            "num_key_value_heads": cfg.num_heads, "head_dim": cfg.qk_rope_head_dim,
            "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim, "intermediate_size": cfg.ffn_hidden_size,
            "first_k_dense_replace": cfg.first_k_dense, "moe_layer_freq": 1,
            "moe_intermediate_size": cfg.moe_ffn_hidden_size, "n_routed_experts": cfg.num_experts,
            "n_shared_experts": cfg.shared_expert_ffn_hidden_size // cfg.moe_ffn_hidden_size,
            "norm_topk_prob": cfg.norm_topk_prob,
            "n_group": groups, "topk_group": cfg.topk_groups if cfg.num_groups else 1,
            "routed_scaling_factor": cfg.routed_scaling_factor,
            "aux_loss_alpha": cfg.aux_loss_coeff if cfg.aux_loss_type != "none" else 0.0,
            "seq_aux": cfg.aux_loss_type == "sequence"}


def _rope_fields(config: dict, family: str) -> dict:
    """Our rope_* fields from config.json's rope_parameters (transformers 5) or rope_scaling + rope_theta (4):
    plain RoPE for every family, YaRN for deepseek_v3 and deepseek_v2 (where our softmax-scale mscale is DeepSeek's)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if "full_attention" in rope:  # transformers 5 may nest the parameters by layer type
        rope = rope["full_attention"]
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise HFError("partial_rotary_factor != 1: our RoPE rotates the whole head")
    default_theta = 1e6 if family == "mixtral" else 10000.0  # the families' defaults when config.json gives none
    fields = {"rope_theta": rope.get("rope_theta", config.get("rope_theta", default_theta))}
    if rope_type == "default":
        return fields
    if rope_type != _ROPE_SCALING.get(family):
        raise HFError(f"RoPE type {rope_type!r}: {family} converts with plain RoPE (rope_type 'default')"
                      + (f" or {_ROPE_SCALING[family]!r}" if family in _ROPE_SCALING else ""))
    if rope_type == "llama3":
        try:
            return {**fields, "rope_scaling": "llama3", "rope_scaling_factor": float(rope["factor"]),
                    "rope_low_freq_factor": float(rope["low_freq_factor"]),
                    "rope_high_freq_factor": float(rope["high_freq_factor"]),
                    "rope_original_max_position": int(rope["original_max_position_embeddings"])}
        except KeyError as e:
            raise HFError(f"RoPE type 'llama3' without its {e} field") from None
    if rope.get("attention_factor") is not None:
        raise HFError(f"YaRN attention_factor={rope['attention_factor']}: we derive it from factor, mscale and "
                      "mscale_all_dim, as DeepSeek-V3 does; drop the field")
    if not rope.get("truncate", True):
        raise HFError("YaRN truncate=false: our correction range is rounded to whole dims (truncate=true)")
    # transformers' order: a top-level original_max_position_embeddings wins; a missing factor is the context ratio
    original = (config.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
                or config["max_position_embeddings"])
    return {**fields, "rope_scaling_factor": float(rope.get("factor") or config["max_position_embeddings"] / original),
            "rope_original_max_position": int(original),
            **{f"rope_{k}": float(rope.get(k) or v) for k, v in _YARN_DEFAULTS.items()},
            # a missing mscale is 0 here: "unused", as transformers treats a missing one
            "rope_mscale": float(rope.get("mscale") or 0.0),
            "rope_mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0)}


def config_from_hf(config: dict) -> tuple[ModelConfig, Family]:
    """Our ModelConfig from an HF config.json of a supported family (transformers 4 or 5 spelling)."""
    family = config.get("model_type")
    if family not in FAMILIES:
        raise HFError(f"config.json model_type {family!r} is not supported: only models of the families "
                      f"{', '.join(FAMILIES)} convert (the dense ones, {', '.join(DENSE)}, to upcycle)")
    if config.get("hidden_act", "silu") != "silu":
        raise HFError(f"hidden_act={config['hidden_act']!r}: our experts are SwiGLU (silu)")
    if config.get("attention_bias"):  # (Llama's and Mistral's: on o_proj too; Qwen2's q/k/v biases are below)
        raise HFError("attention_bias=true: our attention's output projection has no bias")
    rope = _rope_fields(config, family)
    if family in DEEPSEEK:
        return _deepseek_config(config, family, rope), family
    windowed = config.get("use_sliding_window", family in ("mixtral", "mistral"))  # the families' defaults
    window = config.get("sliding_window") if windowed else None
    if window is not None:
        raise HFError(f"sliding_window={window}: our attention is full causal")
    num_layers = config["num_hidden_layers"]
    trunk = dict(vocab_size=config["vocab_size"], hidden_size=config["hidden_size"], num_layers=num_layers,
                 num_heads=config["num_attention_heads"],
                 num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
                 head_dim=config.get("head_dim") or 0, norm_eps=config["rms_norm_eps"], qk_norm=family in _QK_NORM,
                 qkv_bias=family == "qwen2" or (family == "qwen2_moe" and bool(config.get("qkv_bias", True))),
                 init_std=config.get("initializer_range", ModelConfig.init_std), **rope)
    if family in DENSE:
        if config.get("mlp_bias"):
            raise HFError("mlp_bias=true: our MLPs have no biases")
        return ModelConfig(**trunk, first_k_dense=num_layers, ffn_hidden_size=config["intermediate_size"]), family
    num_experts = config.get("num_local_experts", config.get("num_experts"))
    if not num_experts:
        raise HFError(f"num_experts={num_experts}: not an MoE model")
    step = config.get("decoder_sparse_step", 1) or 1
    dense = sorted(set(config.get("mlp_only_layers") or []) | {i for i in range(num_layers) if (i + 1) % step})
    sparse_step = family in ("qwen3_moe", "qwen2_moe")  # families whose dense layers config.json lists
    if sparse_step and dense != list(range(len(dense))):
        raise HFError(f"dense layers {dense} (mlp_only_layers, decoder_sparse_step={step}) must be the leading layers "
                      "(our model's first_k_dense)")
    shared = {}
    if family == "qwen2_moe":  # a shared expert with a sigmoid gate in every MoE layer
        shared = dict(shared_expert_ffn_hidden_size=config["shared_expert_intermediate_size"], shared_expert_gate=True)
    cfg = ModelConfig(**trunk, num_experts=num_experts, top_k=config["num_experts_per_tok"],
                      first_k_dense=len(dense) if sparse_step else 0,
                      # transformers' defaults: Mixtral always renormalises, Qwen3/Qwen2-MoE only with norm_topk_prob
                      norm_topk_prob=True if family == "mixtral" else bool(config.get("norm_topk_prob", False)),
                      aux_loss_coeff=config.get("router_aux_loss_coef", 0.001),
                      moe_ffn_hidden_size=config.get("moe_intermediate_size", config["intermediate_size"]),
                      ffn_hidden_size=config["intermediate_size"] if sparse_step else ModelConfig.ffn_hidden_size,
                      **shared)
    return cfg, family


def _refuse_deepseek_fields(config: dict, family: str) -> None:
    """Fields of DeepSeek's own config.json whose other values transformers ignores or computes differently."""
    wanted_fields = (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")) if family == "deepseek_v3" else \
        (("scoring_func", "softmax"), ("topk_method", "greedy"))
    for key, wanted in (*wanted_fields, ("moe_layer_freq", 1)):
        if config.get(key, wanted) != wanted:
            raise HFError(f"{key}={config[key]!r}: {family} converts with {key}={wanted!r} only")
    if family == "deepseek_v2" and config.get("norm_topk_prob"):
        raise HFError("norm_topk_prob=true: transformers' DeepseekV2 ignores it (never renormalises) where DeepSeek's "
                      "own code renormalises; deepseek_v2 converts with norm_topk_prob=false only")
    if (config.get("n_shared_experts") or 0) < 1:
        raise HFError(f"n_shared_experts={config.get('n_shared_experts')}: {family} converts with shared experts")
    if config["rms_norm_eps"] != LATENT_NORM_EPS:
        raise HFError(f"rms_norm_eps={config['rms_norm_eps']}: transformers' MLA latent norms (q_a_layernorm, "
                      f"kv_a_layernorm) keep eps {LATENT_NORM_EPS} while ours use model.norm_eps for every norm; "
                      f"{family} converts with rms_norm_eps={LATENT_NORM_EPS} only")


def _deepseek_config(config: dict, family: str, rope: dict) -> ModelConfig:
    """DeepseekV3Config or DeepseekV2Config -> ours. num_key_value_heads is not read: every MLA head has its own keys
    and values. DeepSeek-V2 routes greedily (its n_group / topk_group unused)."""
    _refuse_deepseek_fields(config, family)
    heads, num_layers = config["num_attention_heads"], config["num_hidden_layers"]
    groups = (config.get("n_group") or 1) if family == "deepseek_v3" else 1
    moe = {"num_experts": config.get("n_routed_experts", config.get("num_local_experts")),
           "top_k": config["num_experts_per_tok"], "moe_ffn_hidden_size": config["moe_intermediate_size"],
           "shared_expert_ffn_hidden_size": config["n_shared_experts"] * config["moe_intermediate_size"],
           "score_func": "sigmoid" if family == "deepseek_v3" else "softmax",
           "norm_topk_prob": bool(config.get("norm_topk_prob")),
           "num_groups": groups if groups > 1 else 0, "topk_groups": config["topk_group"] if groups > 1 else 0,
           "routed_scaling_factor": float(config.get("routed_scaling_factor") or 1.0),
           "first_k_dense": min(config.get("first_k_dense_replace") or 0, num_layers)}
    if "aux_loss_alpha" in config:  # DeepSeek's sequence-wise balance loss (not part of the function computed)
        moe.update(aux_loss_coeff=config["aux_loss_alpha"],
                   aux_loss_type="sequence" if config.get("seq_aux", True) else "micro_batch")
    mla = {"attention": "mla", "q_lora_rank": config["q_lora_rank"] or 0, "kv_lora_rank": config["kv_lora_rank"],
           "qk_nope_head_dim": config["qk_nope_head_dim"], "qk_rope_head_dim": config["qk_rope_head_dim"],
           "v_head_dim": config["v_head_dim"]}
    mtp = config.get("num_nextn_predict_layers", config.get("num_mtp_layers")) or 0  # transformers 4 | 5 spelling
    return ModelConfig(vocab_size=config["vocab_size"], hidden_size=config["hidden_size"], num_layers=num_layers,
                       num_heads=heads, num_kv_heads=heads, ffn_hidden_size=config["intermediate_size"],
                       mtp_num_layers=mtp if family == "deepseek_v3" else 0,
                       norm_eps=config["rms_norm_eps"], init_std=config.get("initializer_range", ModelConfig.init_std),
                       **mla, **moe, **rope)
