"""Rotary position embedding, indexed by each token's position inside its own document (packed sequences).

The rotation itself, with the QK-norm before it, is kernels/head_norm_rope.py (a Triton pair on CUDA, its torch
reference `apply_rope` elsewhere); here are the frequencies every attention layer keeps as a buffer, and two context
extensions: YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models"), with the
semantics of transformers' "yarn" rope type and DeepSeek-V2/V3's softmax-scale correction, and Llama 3.1's ("llama3"
rope type: the frequencies alone, `llama3_frequencies`).

YaRN changes three things. The frequencies: those that turn many times over the pre-training context (high
frequencies, local order) are kept, those that turn less than once are interpolated (divided by the factor), and a
linear ramp blends the ones between (`yarn_frequencies`). The rotated q and k: transformers multiplies cos and sin by an
`attention_factor` (`yarn_rotary_scale`). The softmax: DeepSeek multiplies its scale by mscale(factor, mscale_all_dim)^2
(`yarn_softmax_scale`). The attention layers fold the last two into a scale of the queries (`query_scales`), so the
attention cores, the context-parallel ring and the rollout KV cache run unchanged: scores are bilinear in q and k, so
scaling q's rotated dims by the factor squared equals scaling both rotated q and k by it.
"""

from __future__ import annotations

import math

import torch

from services.common.config import ModelConfig


def rope_frequencies(head_dim: int, theta: float, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction, 0.1·mscale·ln(factor) + 1 (1 without scaling)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _correction_dim(rotations: float, dim: int, theta: float, original_max: int) -> float:
    """The (fractional) frequency index whose wavelength turns `rotations` times over `original_max` positions."""
    return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_frequencies(dim: int, cfg: ModelConfig) -> torch.Tensor:
    """inv_freq [dim/2] of YaRN with `cfg.rope_scaling_factor` (transformers' `_compute_yarn_parameters`, truncated
    correction range as its default)."""
    theta, factor = cfg.rope_theta, cfg.rope_scaling_factor
    low = max(math.floor(_correction_dim(cfg.rope_beta_fast, dim, theta, cfg.rope_original_max_position)), 0)
    high = min(math.ceil(_correction_dim(cfg.rope_beta_slow, dim, theta, cfg.rope_original_max_position)), dim - 1)
    if low == high:
        high += 0.001  # a ramp of width zero would divide by zero
    # 1 below `low` (the pre-trained frequency kept), 0 above `high` (interpolated); in transformers' float order
    keep = 1 - ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    wavelengths = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # / 2π
    return 1.0 / (factor * wavelengths) * (1 - keep) + 1.0 / wavelengths * keep


def llama3_frequencies(dim: int, cfg: ModelConfig) -> torch.Tensor:
    """inv_freq [dim/2] of Llama 3.1's context extension (`model.rope_scaling=llama3`): by how many turns each frequency
    makes over the original context, divided by the factor (fewer than rope_low_freq_factor), kept (more than
    rope_high_freq_factor), or a linear blend of the two in the turns between."""
    inv = rope_frequencies(dim, cfg.rope_theta)
    turns = cfg.rope_original_max_position * inv / (2 * math.pi)
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    kept = ((turns - low) / (high - low)).clamp(0, 1)
    return inv / cfg.rope_scaling_factor * (1 - kept) + inv * kept


def yarn_rotary_scale(cfg: ModelConfig) -> float:
    """The factor on the rotated q and k (transformers' cos/sin `attention_factor`)."""
    f = cfg.rope_scaling_factor
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return yarn_mscale(f, cfg.rope_mscale) / yarn_mscale(f, cfg.rope_mscale_all_dim)
    return yarn_mscale(f)


def yarn_softmax_scale(cfg: ModelConfig) -> float:
    """The factor on the softmax scale 1/sqrt(qk head dim) (DeepSeek's `yarn_apply_mscale`)."""
    return yarn_mscale(cfg.rope_scaling_factor, cfg.rope_mscale_all_dim) ** 2 if cfg.rope_mscale_all_dim else 1.0


def rotary(dim: int, cfg: ModelConfig) -> torch.Tensor:
    """inv_freq [dim/2] for the `dim` rotated dims of a head: plain RoPE, or when `cfg.rope_scaling_factor` > 1, YaRN's
    or Llama 3.1's (`cfg.rope_scaling`)."""
    if cfg.rope_scaling_factor <= 1:
        return rope_frequencies(dim, cfg.rope_theta)
    return yarn_frequencies(dim, cfg) if cfg.rope_scaling == "yarn" else llama3_frequencies(dim, cfg)


def query_scales(cfg: ModelConfig) -> tuple[float, float]:
    """(scale of q's unrotated dims, scale of its rotated dims) that give the attention cores' default softmax scale
    1/sqrt(qk head dim) YaRN's scores: the softmax correction on all dims, the rotary scale squared on the rotated."""
    if cfg.rope_scaling_factor <= 1 or cfg.rope_scaling != "yarn":  # Llama 3.1's scales neither
        return 1.0, 1.0
    softmax = yarn_softmax_scale(cfg)
    return softmax, softmax * yarn_rotary_scale(cfg) ** 2
