"""Rotary position embedding, indexed by each token's position inside its own document (packed sequences).

The rotation itself, with the QK-norm before it, is kernels/head_norm_rope.py (a Triton pair on CUDA, its torch
reference `apply_rope` elsewhere); here are the frequencies every attention layer keeps as a buffer.
"""

from __future__ import annotations

import torch


def rope_frequencies(head_dim: int, theta: float, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
