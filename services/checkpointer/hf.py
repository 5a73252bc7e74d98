"""Hugging Face interop: our full (unsharded) model state dict <-> HF safetensors + config.json, and dense -> MoE upcycling.

This is the one checkpointer module that knows parameter names; it follows `services/trainer/model/` (MoETransformer):
`embed`, `layers.{i}.attn.{q,k,v,o}_proj`, `attn_norm`, `mlp_norm`, dense `mlp.{gate,up,down}_proj`, MoE
`mlp.router.weight` / `mlp.router.expert_bias` / `mlp.experts.w13` [E, h, 2f] (gate columns first) / `mlp.experts.w2`
[E, f, h], `norm`, `output`. HF `nn.Linear` weights are [out, in]; our stacked experts are [in, out], hence transposes.

Families: "mixtral" (MixtralForCausalLM: `block_sparse_moe.gate`, `experts.{e}.w1/w3/w2`) and "qwen3_moe"
(Qwen3MoeForCausalLM: `mlp.gate`, `experts.{e}.gate_proj/up_proj/down_proj`). Qwen3-MoE also has per-head q/k RMSNorm,
which our attention does not: export writes unit weights and import accepts only unit weights (anything else would
silently change the model), so Qwen3 interop is exact only for models that never trained those norms.
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


class HFError(ValueError):
    """A model or HF checkpoint that cannot be converted; the message says what does not fit."""


def _check_family(cfg: ModelConfig, family: str) -> None:
    if family not in _MOE:
        raise HFError(f"unknown HF family {family!r}; supported: {sorted(_MOE)}")
    if cfg.shared_expert_ffn_hidden_size:
        raise HFError(f"{family} has no shared expert but `model.shared_expert_ffn_hidden_size="
                      f"{cfg.shared_expert_ffn_hidden_size}`")
    if family == "mixtral" and cfg.first_k_dense:
        raise HFError(f"mixtral has no dense layers but `model.first_k_dense={cfg.first_k_dense}`")


def to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, family: Family) -> dict[str, torch.Tensor]:
    """Our full state dict -> HF names and layouts."""
    _check_family(cfg, family)
    block, gate_name, (w_gate, w_up, w_down) = _MOE[family]
    f = cfg.moe_ffn_hidden_size
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"],
           "lm_head.weight": state["output.weight"]}
    for i in range(cfg.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        out[hf + "input_layernorm.weight"] = state[ours + "attn_norm.weight"]
        out[hf + "post_attention_layernorm.weight"] = state[ours + "mlp_norm.weight"]
        for p in _ATTN:
            out[f"{hf}self_attn.{p}.weight"] = state[f"{ours}attn.{p}.weight"]
        if family == "qwen3_moe":
            for p in ("q_norm", "k_norm"):
                out[f"{hf}self_attn.{p}.weight"] = torch.ones(cfg.kv_channels, dtype=state["norm.weight"].dtype)
        if i < cfg.first_k_dense:
            for p in ("gate_proj", "up_proj", "down_proj"):
                out[f"{hf}mlp.{p}.weight"] = state[f"{ours}mlp.{p}.weight"]
            continue
        out[f"{hf}{block}.{gate_name}.weight"] = state[ours + "mlp.router.weight"]
        w13, w2 = state[ours + "mlp.experts.w13"], state[ours + "mlp.experts.w2"]
        for e in range(cfg.num_experts):
            prefix = f"{hf}{block}.experts.{e}."
            out[prefix + f"{w_gate}.weight"] = w13[e, :, :f].T.contiguous()
            out[prefix + f"{w_up}.weight"] = w13[e, :, f:].T.contiguous()
            out[prefix + f"{w_down}.weight"] = w2[e].T.contiguous()
    return out


def from_hf(hf: dict[str, torch.Tensor], cfg: ModelConfig, family: Family) -> dict[str, torch.Tensor]:
    """HF names and layouts -> our full state dict (expert bias starts at zero: HF has none)."""
    _check_family(cfg, family)
    block, gate_name, (w_gate, w_up, w_down) = _MOE[family]

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise HFError(f"HF checkpoint has no {name!r}; is it a {family} model with {cfg.num_layers} layers and "
                          f"{cfg.num_experts} experts?")
        return hf[name]

    out = {"embed.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight"),
           "output.weight": take("lm_head.weight")}
    for i in range(cfg.num_layers):
        ours, pre = f"layers.{i}.", f"model.layers.{i}."
        out[ours + "attn_norm.weight"] = take(pre + "input_layernorm.weight")
        out[ours + "mlp_norm.weight"] = take(pre + "post_attention_layernorm.weight")
        for p in _ATTN:
            out[f"{ours}attn.{p}.weight"] = take(f"{pre}self_attn.{p}.weight")
        for p in ("q_norm", "k_norm"):
            w = hf.get(f"{pre}self_attn.{p}.weight")
            if w is not None and not torch.all(w == 1):
                raise HFError(f"{pre}self_attn.{p}.weight is not all ones; our attention has no QK-norm, so importing "
                              "it would change the model")
        if i < cfg.first_k_dense:
            for p in ("gate_proj", "up_proj", "down_proj"):
                out[f"{ours}mlp.{p}.weight"] = take(f"{pre}mlp.{p}.weight")
            continue
        out[ours + "mlp.router.weight"] = take(f"{pre}{block}.{gate_name}.weight")
        out[ours + "mlp.router.expert_bias"] = torch.zeros(cfg.num_experts, dtype=torch.float32)
        experts = [f"{pre}{block}.experts.{e}." for e in range(cfg.num_experts)]
        out[ours + "mlp.experts.w13"] = torch.stack([
            torch.cat([take(p + f"{w_gate}.weight").T, take(p + f"{w_up}.weight").T], dim=1) for p in experts])
        out[ours + "mlp.experts.w2"] = torch.stack([take(p + f"{w_down}.weight").T for p in experts])
    return out


def hf_config(cfg: ModelConfig, family: Family, dtype: str = "bfloat16", max_positions: int = 4096) -> dict:
    common = {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
              "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
              "head_dim": cfg.kv_channels, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps,
              "rope_theta": cfg.rope_theta, "num_experts_per_tok": cfg.top_k, "tie_word_embeddings": False,
              "hidden_act": "silu", "max_position_embeddings": max_positions, "torch_dtype": dtype,
              "initializer_range": cfg.init_std}
    if family == "mixtral":
        return {**common, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "intermediate_size": cfg.moe_ffn_hidden_size, "num_local_experts": cfg.num_experts,
                "router_aux_loss_coef": cfg.aux_loss_coeff}
    return {**common, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "intermediate_size": cfg.ffn_hidden_size, "moe_intermediate_size": cfg.moe_ffn_hidden_size,
            "num_experts": cfg.num_experts, "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(cfg.first_k_dense)), "router_aux_loss_coef": cfg.aux_loss_coeff}


def config_from_hf(config: dict) -> tuple[ModelConfig, Family]:
    """Our ModelConfig from an HF config.json of a supported family."""
    family = config.get("model_type")
    if family not in _MOE:
        raise HFError(f"config.json model_type {family!r} is not supported (supported: {sorted(_MOE)})")
    dense = list(config.get("mlp_only_layers", []))
    if dense != list(range(len(dense))):
        raise HFError(f"mlp_only_layers={dense} must be the leading layers (our model's first_k_dense)")
    cfg = ModelConfig(vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
                      num_layers=config["num_hidden_layers"], num_heads=config["num_attention_heads"],
                      num_kv_heads=config["num_key_value_heads"], head_dim=config.get("head_dim", 0) or 0,
                      num_experts=config.get("num_local_experts", config.get("num_experts")),
                      top_k=config["num_experts_per_tok"], norm_eps=config["rms_norm_eps"],
                      rope_theta=config.get("rope_theta", 10000.0), first_k_dense=len(dense),
                      norm_topk_prob=config.get("norm_topk_prob", True),
                      moe_ffn_hidden_size=config.get("moe_intermediate_size", config["intermediate_size"]),
                      ffn_hidden_size=config["intermediate_size"] if family == "qwen3_moe" else ModelConfig.ffn_hidden_size)
    return cfg, family


def export_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, family: Family, out_dir: str | Path,
              dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `model.safetensors` and `config.json` loadable by transformers' {Mixtral,Qwen3Moe}ForCausalLM."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in to_hf(state, cfg, family).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(cfg, family, str(dtype).removeprefix("torch.")), indent=1))
    return out


def import_hf(src: str | Path, dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Read an HF model directory (config.json + one or more *.safetensors) into our state dict and config."""
    src = Path(src)
    if not (src / "config.json").is_file():
        raise HFError(f"{src / 'config.json'} is missing; point at an HF model directory")
    cfg, family = config_from_hf(json.loads((src / "config.json").read_text()))
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise HFError(f"no *.safetensors files in {src}")
    hf: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                hf[key] = f.get_tensor(key).to(dtype)
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
