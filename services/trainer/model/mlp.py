"""Dense SwiGLU MLP (dense first layers and shared experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.trainer.model.fp8_linear import FP8Linear


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, fp8: str = ""):
        super().__init__()
        # nn.Linear layers whose matmuls run in FP8 on CUDA when `fp8` (config `model.fp8`) is set: fp8_linear.py.
        self.gate_proj = FP8Linear(hidden_size, ffn_hidden_size, fp8=fp8)
        self.up_proj = FP8Linear(hidden_size, ffn_hidden_size, fp8=fp8)
        self.down_proj = FP8Linear(ffn_hidden_size, hidden_size, fp8=fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
