"""Hugging Face interop: our full (unsharded) model state dict <-> HF safetensors + config.json, and dense -> MoE upcycling.

This is the one checkpointer module that knows parameter names; it follows `services/trainer/model/` (MoETransformer):
`embed`, `layers.{i}.attn.{q,k,v,o}_proj`, `attn.{q,k}_norm` (with `model.qk_norm`), `attn_norm`, `mlp_norm`, dense
`mlp.{gate,up,down}_proj`, MoE `mlp.router.weight` / `mlp.router.expert_bias` / `mlp.experts.w13` [E, h, 2f] (gate
columns first) / `mlp.experts.w2` [E, f, h], `norm`, `output`. HF `nn.Linear` weights are [out, in]; our stacked experts
are [in, out], hence transposes.

Families: "mixtral" (MixtralForCausalLM: `block_sparse_moe.gate`, `experts.{e}.w1/w3/w2`, no QK-norm, top-k
probabilities always renormalised) and "qwen3_moe" (Qwen3MoeForCausalLM: `mlp.gate`, `experts.{e}.gate_proj/up_proj/
down_proj`, per-head `self_attn.{q,k}_norm`, `norm_topk_prob` as configured, leading dense layers as `mlp_only_layers`).
Export writes this per-expert ("original") layout, which every transformers version loads; import also reads the fused
layout transformers 5 keeps in memory (`mlp.experts.gate_up_proj` [E, 2f, h] / `down_proj` [E, h, f], `mlp.gate`).

Conversion is exact or refused: a config or state the family cannot express (a shared expert, sigmoid or group-limited
routing, expert capacity, a trained expert bias, QK-norm on Mixtral or its absence on Qwen3, RoPE scaling, attention
biases, sliding windows, ...) raises `HFError` naming what does not fit, and so does an HF tensor that import would
otherwise drop. tests/test_checkpointer_hf_transformers.py checks that transformers computes the same logits.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from services.common.config import ModelConfig

Family = Literal["mixtral", "qwen3_moe"]
_MOE = {"mixtral": ("block_sparse_moe", "gate", ("w1", "w3", "w2")),
        "qwen3_moe": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj"))}
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_QK_NORM = ("q_norm", "k_norm")
_ARCH = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")  # a non-persistent buffer some older HF checkpoints still hold


class HFError(ValueError):
    """A model or HF checkpoint that cannot be converted; the message says what does not fit."""


def _check_family(cfg: ModelConfig, family: str) -> None:
    """Refuse a config whose model the HF family would compute differently."""
    if family not in _MOE:
        raise HFError(f"unknown HF family {family!r}; choose one of {', '.join(sorted(_MOE))}")
    if cfg.shared_expert_ffn_hidden_size:
        raise HFError(f"{family} has no shared expert but `model.shared_expert_ffn_hidden_size="
                      f"{cfg.shared_expert_ffn_hidden_size}`")
    if family == "mixtral" and cfg.first_k_dense:
        raise HFError(f"mixtral has no dense layers but `model.first_k_dense={cfg.first_k_dense}`")
    if cfg.qk_norm != (family == "qwen3_moe"):
        raise HFError(f"{family} {'has' if family == 'qwen3_moe' else 'has no'} per-head q/k RMSNorm: it needs "
                      f"`model.qk_norm={str(family == 'qwen3_moe').lower()}`, got {str(cfg.qk_norm).lower()}")
    if cfg.score_func != "softmax":
        raise HFError(f"{family} routes with softmax scores but `model.score_func={cfg.score_func}`")
    if cfg.num_groups:
        raise HFError(f"{family} has no group-limited routing but `model.num_groups={cfg.num_groups}`")
    if cfg.routed_scaling_factor != 1.0:
        raise HFError(f"{family} does not scale routed outputs but `model.routed_scaling_factor="
                      f"{cfg.routed_scaling_factor}`")
    if cfg.capacity_factor > 0:
        raise HFError(f"{family} is dropless but `model.capacity_factor={cfg.capacity_factor}` drops tokens")
    if family == "mixtral" and not cfg.norm_topk_prob:
        raise HFError("mixtral always renormalises its top-k probabilities (softmax over the top-k logits): it needs "
                      "`model.norm_topk_prob=true`")


def to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, family: Family) -> dict[str, torch.Tensor]:
    """Our full state dict -> HF names and layouts (the per-expert layout every transformers version reads)."""
    _check_family(cfg, family)
    block, gate_name, (w_gate, w_up, w_down) = _MOE[family]
    f = cfg.moe_ffn_hidden_size
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"],
           "lm_head.weight": state["output.weight"]}
    for i in range(cfg.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        out[hf + "input_layernorm.weight"] = state[ours + "attn_norm.weight"]
        out[hf + "post_attention_layernorm.weight"] = state[ours + "mlp_norm.weight"]
        for p in _ATTN + (_QK_NORM if cfg.qk_norm else ()):
            out[f"{hf}self_attn.{p}.weight"] = state[f"{ours}attn.{p}.weight"]
        if i < cfg.first_k_dense:
            for p in ("gate_proj", "up_proj", "down_proj"):
                out[f"{hf}mlp.{p}.weight"] = state[f"{ours}mlp.{p}.weight"]
            continue
        bias = state.get(ours + "mlp.router.expert_bias")
        if bias is not None and bool(torch.any(bias != 0)):
            raise HFError(f"{ours}mlp.router.expert_bias is not zero (aux-loss-free balancing): {family} routes "
                          "without a selection bias, so the exported model would pick other experts")
        out[f"{hf}{block}.{gate_name}.weight"] = state[ours + "mlp.router.weight"]
        w13, w2 = state[ours + "mlp.experts.w13"], state[ours + "mlp.experts.w2"]
        for e in range(cfg.num_experts):
            prefix = f"{hf}{block}.experts.{e}."
            out[prefix + f"{w_gate}.weight"] = w13[e, :, :f].T.contiguous()
            out[prefix + f"{w_up}.weight"] = w13[e, :, f:].T.contiguous()
            out[prefix + f"{w_down}.weight"] = w2[e].T.contiguous()
    return out


def from_hf(hf: dict[str, torch.Tensor], cfg: ModelConfig, family: Family) -> dict[str, torch.Tensor]:
    """HF names and layouts -> our full state dict (expert bias starts at zero: HF has none).

    Reads the per-expert layout and transformers 5's fused one (`mlp.experts.gate_up_proj` / `down_proj`); every HF
    tensor must be used, so nothing the family computes with is dropped.
    """
    _check_family(cfg, family)
    block, gate_name, (w_gate, w_up, w_down) = _MOE[family]
    used: set[str] = set()

    def take(*names: str) -> torch.Tensor:
        """The first of `names` the checkpoint has (alternative spellings of one tensor)."""
        for name in names:
            if name in hf:
                used.add(name)
                return hf[name]
        raise HFError(f"HF checkpoint has no {names[0]!r}; is it a {family} model with {cfg.num_layers} layers and "
                      f"{cfg.num_experts} experts?")

    out = {"embed.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight"),
           "output.weight": take("lm_head.weight")}
    for i in range(cfg.num_layers):
        ours, pre = f"layers.{i}.", f"model.layers.{i}."
        out[ours + "attn_norm.weight"] = take(pre + "input_layernorm.weight")
        out[ours + "mlp_norm.weight"] = take(pre + "post_attention_layernorm.weight")
        for p in _ATTN + (_QK_NORM if cfg.qk_norm else ()):
            out[f"{ours}attn.{p}.weight"] = take(f"{pre}self_attn.{p}.weight")
        if i < cfg.first_k_dense:
            for p in ("gate_proj", "up_proj", "down_proj"):
                out[f"{ours}mlp.{p}.weight"] = take(f"{pre}mlp.{p}.weight")
            continue
        out[ours + "mlp.router.weight"] = take(f"{pre}{block}.{gate_name}.weight", f"{pre}mlp.gate.weight")
        out[ours + "mlp.router.expert_bias"] = torch.zeros(cfg.num_experts, dtype=torch.float32)
        fused = f"{pre}mlp.experts."
        if fused + "gate_up_proj" in hf:  # [E, 2f, h] (gate rows first) and [E, h, f]
            out[ours + "mlp.experts.w13"] = take(fused + "gate_up_proj").transpose(1, 2).contiguous()
            out[ours + "mlp.experts.w2"] = take(fused + "down_proj").transpose(1, 2).contiguous()
            continue
        experts = [f"{pre}{block}.experts.{e}." for e in range(cfg.num_experts)]
        out[ours + "mlp.experts.w13"] = torch.stack([
            torch.cat([take(p + f"{w_gate}.weight").T, take(p + f"{w_up}.weight").T], dim=1) for p in experts])
        out[ours + "mlp.experts.w2"] = torch.stack([take(p + f"{w_down}.weight").T for p in experts])
    unused = sorted(k for k in hf if k not in used and not _IGNORED.search(k))
    if unused:
        raise HFError(f"HF checkpoint has {len(unused)} tensors a {family} model of this config does not use (e.g. "
                      f"{unused[:3]}); converting would drop them")
    return out


def hf_config(cfg: ModelConfig, family: Family, dtype: str = "bfloat16", max_positions: int = 4096) -> dict:
    """config.json for transformers: every field that decides what the HF model computes is written explicitly, so the
    model does not depend on a transformers version's defaults."""
    _check_family(cfg, family)
    common = {"architectures": [_ARCH[family]], "model_type": family,
              "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
              "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
              "head_dim": cfg.kv_channels, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps,
              # transformers < 5 reads rope_theta, 5 reads rope_parameters (and still accepts rope_theta alone)
              "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
              "num_experts_per_tok": cfg.top_k, "tie_word_embeddings": False, "hidden_act": "silu",
              "max_position_embeddings": max_positions, "torch_dtype": dtype, "dtype": dtype,
              "initializer_range": cfg.init_std, "attention_dropout": 0.0, "sliding_window": None,
              "router_aux_loss_coef": cfg.aux_loss_coeff if cfg.aux_loss_type != "none" else 0.0,
              "output_router_logits": False, "use_cache": True}
    if family == "mixtral":  # always renormalises the top-k probabilities: no norm_topk_prob field
        return {**common, "intermediate_size": cfg.moe_ffn_hidden_size, "num_local_experts": cfg.num_experts,
                "router_jitter_noise": 0.0}
    return {**common, "intermediate_size": cfg.ffn_hidden_size, "moe_intermediate_size": cfg.moe_ffn_hidden_size,
            "num_experts": cfg.num_experts, "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(cfg.first_k_dense)), "attention_bias": False, "use_sliding_window": False}


def config_from_hf(config: dict) -> tuple[ModelConfig, Family]:
    """Our ModelConfig from an HF config.json of a supported family (transformers 4 or 5 spelling)."""
    family = config.get("model_type")
    if family not in _MOE:
        raise HFError(f"config.json model_type {family!r} is not supported: only MoE models of the families "
                      f"{', '.join(sorted(_MOE))} convert")
    if config.get("hidden_act", "silu") != "silu":
        raise HFError(f"hidden_act={config['hidden_act']!r}: our experts are SwiGLU (silu)")
    if config.get("attention_bias"):
        raise HFError("attention_bias=true: our attention projections have no biases")
    window = config.get("sliding_window") if config.get("use_sliding_window", family == "mixtral") else None
    if window is not None:
        raise HFError(f"sliding_window={window}: our attention is full causal")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if "full_attention" in rope:  # transformers 5 may nest the parameters by layer type
        rope = rope["full_attention"]
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise HFError(f"RoPE type {rope_type!r}: only plain RoPE (rope_type 'default') is supported")
    if rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise HFError("partial_rotary_factor != 1: our RoPE rotates the whole head")
    default_theta = 1e6 if family == "mixtral" else 10000.0  # the families' defaults when config.json gives none
    rope_theta = rope.get("rope_theta", config.get("rope_theta", default_theta))

    num_layers = config["num_hidden_layers"]
    num_experts = config.get("num_local_experts", config.get("num_experts"))
    if not num_experts:
        raise HFError(f"num_experts={num_experts}: not an MoE model")
    step = config.get("decoder_sparse_step", 1) or 1
    dense = sorted(set(config.get("mlp_only_layers") or []) | {i for i in range(num_layers) if (i + 1) % step})
    if family == "qwen3_moe" and dense != list(range(len(dense))):
        raise HFError(f"dense layers {dense} (mlp_only_layers, decoder_sparse_step={step}) must be the leading layers "
                      "(our model's first_k_dense)")
    cfg = ModelConfig(vocab_size=config["vocab_size"], hidden_size=config["hidden_size"], num_layers=num_layers,
                      num_heads=config["num_attention_heads"],
                      num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
                      head_dim=config.get("head_dim") or 0, num_experts=num_experts,
                      top_k=config["num_experts_per_tok"], norm_eps=config["rms_norm_eps"], rope_theta=rope_theta,
                      first_k_dense=len(dense) if family == "qwen3_moe" else 0,
                      # transformers' defaults: Mixtral always renormalises, Qwen3-MoE only with norm_topk_prob
                      norm_topk_prob=True if family == "mixtral" else bool(config.get("norm_topk_prob", False)),
                      qk_norm=family == "qwen3_moe",
                      aux_loss_coeff=config.get("router_aux_loss_coef", 0.001),
                      init_std=config.get("initializer_range", ModelConfig.init_std),
                      moe_ffn_hidden_size=config.get("moe_intermediate_size", config["intermediate_size"]),
                      ffn_hidden_size=config["intermediate_size"] if family == "qwen3_moe" else ModelConfig.ffn_hidden_size)
    return cfg, family


def export_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, family: Family, out_dir: str | Path,
              dtype: torch.dtype = torch.bfloat16, max_positions: int = 4096) -> Path:
    """Write `model.safetensors` and `config.json` loadable by transformers' {Mixtral,Qwen3Moe}ForCausalLM."""
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in to_hf(state, cfg, family).items()}
    config = hf_config(cfg, family, str(dtype).removeprefix("torch."), max_positions)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def import_hf(src: str | Path, dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Read an HF model directory (config.json + one or more *.safetensors) into our state dict and config."""
    src = Path(src)
    if not (src / "config.json").is_file():
        raise HFError(f"{src / 'config.json'} is missing; point at an HF model directory")
    try:
        config = json.loads((src / "config.json").read_text())
        cfg, family = config_from_hf(config)
    except json.JSONDecodeError as e:
        raise HFError(f"{src / 'config.json'} is not valid JSON ({e})") from None
    except KeyError as e:
        raise HFError(f"{src / 'config.json'} has no {e} field: not a complete HF model config") from None
    except (TypeError, AttributeError) as e:  # a field of the wrong kind
        raise HFError(f"{src / 'config.json'} is not an HF model config ({type(e).__name__}: {e})") from None
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise HFError(f"no *.safetensors files in {src}; point at an HF model directory")
    hf: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    hf[key] = f.get_tensor(key).to(dtype)
        except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types (SafetensorError, OSError)
            raise HFError(f"{file} cannot be read as safetensors ({e}); the file is corrupt or truncated") from None
    if "lm_head.weight" not in hf and config.get("tie_word_embeddings") and "model.embed_tokens.weight" in hf:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"].clone()  # tied: our output layer gets its own copy
    return from_hf(hf, cfg, family), cfg


def upcycle(dense: dict[str, torch.Tensor], dense_cfg: ModelConfig, moe_cfg: ModelConfig,
            seed: int = 0) -> dict[str, torch.Tensor]:
    """A dense model's state -> an MoE model's (sparse upcycling): every expert starts as a copy of the layer's MLP and
    the router is freshly initialised, so the MoE computes the dense function whenever top-k weights sum to 1."""
    mismatched = [k for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size")
                  if getattr(dense_cfg, k) != getattr(moe_cfg, k)]
    if mismatched:
        raise HFError(f"upcycling keeps the trunk: dense and MoE configs differ in {mismatched}")
    if moe_cfg.moe_ffn_hidden_size != dense_cfg.ffn_hidden_size:
        raise HFError(f"experts copy the dense MLP: need `model.moe_ffn_hidden_size={dense_cfg.ffn_hidden_size}` "
                      f"(the dense ffn_hidden_size), got {moe_cfg.moe_ffn_hidden_size}")
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    mlp = re.compile(r"^layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight$")
    for name, t in dense.items():
        m = mlp.match(name)
        if m is None or int(m.group(1)) < moe_cfg.first_k_dense:
            out[name] = t
    for i in range(moe_cfg.first_k_dense, moe_cfg.num_layers):
        p, E = f"layers.{i}.mlp.", moe_cfg.num_experts
        gate, up, down = (dense[f"{p}{n}_proj.weight"] for n in ("gate", "up", "down"))
        out[p + "experts.w13"] = torch.cat([gate.T, up.T], dim=1).unsqueeze(0).repeat(E, 1, 1)
        out[p + "experts.w2"] = down.T.unsqueeze(0).repeat(E, 1, 1).contiguous()
        out[p + "router.weight"] = torch.randn(E, moe_cfg.hidden_size, generator=g).to(gate.dtype) * moe_cfg.init_std
        out[p + "router.expert_bias"] = torch.zeros(E, dtype=torch.float32)
    return out
