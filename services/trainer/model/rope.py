"""Rotary position embedding, indexed by each token's position inside its own document (packed sequences)."""

from __future__ import annotations

import torch


def rope_frequencies(head_dim: int, theta: float, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def apply_rope(x: torch.Tensor, position_ids: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; rotates pairs (i, i + d/2) by angle pos * inv_freq[i] (computed in fp32)."""
    angles = position_ids.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, d/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
