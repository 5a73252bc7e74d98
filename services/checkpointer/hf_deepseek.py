"""DeepSeek-V3 checkpoint layouts, for services/checkpointer/hf.py: Multi-head Latent Attention weights with their RoPE
rows reordered, and the FP8 block quantisation of the published checkpoints.

RoPE order. DeepSeek's rotary dims come in interleaved pairs (x0, x1), (x2, x3), ... each rotated by one frequency
(transformers' `rope_interleave=True`, `apply_rotary_pos_emb_interleave`); ours rotate x_i with x_{i+d/2} (rotate-half,
services/trainer/model/rope.py). Reordering the rope rows of the projections that produce q and k, per head, from
(x0, x1, x2, x3, ...) to (x0, x2, ... | x1, x3, ...) makes our rotation of the reordered vector equal to HF's rotation
of the original one, in HF's own output order (evens then odds): q.k, and so the attention, is the same. Only the
rows change: q_proj / q_b_proj per head [nope | rope], and kv_a_proj_with_mqa [latent | k_rope].

FP8. Published DeepSeek-V3 weights are float8_e4m3fn with a float32 `weight_scale_inv` per 128x128 block (the last
blocks of a row or column cut short): the real weight is fp8 * scale, block by block.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from services.common.config import ModelConfig

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, which q_a_layernorm / kv_a_layernorm keep


def mla_names(cfg: ModelConfig) -> tuple[str, ...]:
    """The MLA attention's weights, named alike under `layers.{i}.attn.` (ours) and `model.layers.{i}.self_attn.`."""
    q = ("q_a_proj", "q_a_layernorm", "q_b_proj") if cfg.q_lora_rank else ("q_proj",)
    return q + ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")


def deinterleave_rope(w: torch.Tensor, heads: int, rope_dim: int) -> torch.Tensor:
    """Rows of `w` [heads * head_rows, in], each head's last `rope_dim` rows interleaved pairs -> [evens | odds]."""
    w = w.reshape(heads, -1, w.shape[-1])
    rope = w[:, -rope_dim:]
    return torch.cat([w[:, :-rope_dim], rope[:, 0::2], rope[:, 1::2]], dim=1).reshape(-1, w.shape[-1])


def interleave_rope(w: torch.Tensor, heads: int, rope_dim: int) -> torch.Tensor:
    """The inverse of `deinterleave_rope`: [evens | odds] -> interleaved pairs."""
    w = w.reshape(heads, -1, w.shape[-1])
    rope = w[:, -rope_dim:]
    pairs = torch.stack([rope[:, : rope_dim // 2], rope[:, rope_dim // 2:]], dim=2).reshape(rope.shape)
    return torch.cat([w[:, :-rope_dim], pairs], dim=1).reshape(-1, w.shape[-1])


def _rope_rows(cfg: ModelConfig) -> dict[str, int]:
    """Projection -> how many heads its rows hold; each head ends in qk_rope_head_dim rope rows."""
    return {("q_b_proj" if cfg.q_lora_rank else "q_proj"): cfg.num_heads, "kv_a_proj_with_mqa": 1}


def mla_to_hf(state: Mapping[str, torch.Tensor], cfg: ModelConfig, ours: str, hf: str) -> dict[str, torch.Tensor]:
    """One layer's MLA weights -> HF's, rope rows interleaved (`rope_interleave=True`, the published layout)."""
    out = {f"{hf}self_attn.{n}.weight": state[f"{ours}attn.{n}.weight"] for n in mla_names(cfg)}
    for name, heads in _rope_rows(cfg).items():
        key = f"{hf}self_attn.{name}.weight"
        out[key] = interleave_rope(out[key], heads, cfg.qk_rope_head_dim)
    return out


def mla_from_hf(take: Callable[[str], torch.Tensor], cfg: ModelConfig, ours: str, hf: str,
                rope_interleave: bool) -> dict[str, torch.Tensor]:
    """One layer's HF MLA weights (read through `take`) -> ours; rope rows de-interleaved when HF interleaves them."""
    out = {f"{ours}attn.{n}.weight": take(f"{hf}self_attn.{n}.weight") for n in mla_names(cfg)}
    if rope_interleave:
        for name, heads in _rope_rows(cfg).items():
            key = f"{ours}attn.{name}.weight"
            out[key] = deinterleave_rope(out[key], heads, cfg.qk_rope_head_dim)
    return out


def check_block_scales(weight: tuple[int, ...], scales: tuple[int, ...], block: tuple[int, int]) -> None:
    """Raises ValueError unless `scales` (a shape) holds one scale per `block` of a 2-D `weight` (a shape)."""
    if len(weight) != 2:
        raise ValueError(f"a block-quantised weight is 2-D, this one is {list(weight)}")
    (rows, cols), (br, bc) = weight, block
    expected = (-(-rows // br), -(-cols // bc))
    if tuple(scales) != expected:
        raise ValueError(f"weight {list(weight)} in {br}x{bc} blocks needs {list(expected)} scales, got {list(scales)}")


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """fp8 `weight` [R, C] times its per-block `scale_inv` [ceil(R/br), ceil(C/bc)] -> `dtype` (math in fp32).
    Raises ValueError when the scales do not tile the weight."""
    check_block_scales(tuple(weight.shape), tuple(scale_inv.shape), block)
    (rows, cols), (br, bc) = weight.shape, block
    scale = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (weight.float() * scale).to(dtype)
