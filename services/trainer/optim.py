"""AdamW with a linear-warmup + cosine schedule. Norm scales, biases and router bias are not weight-decayed."""

from __future__ import annotations

import math

import torch
from torch import nn

from services.common.config import OptimizerConfig


def lr_at(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_adamw(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, fused=fused)


def clip_and_step(optimizer: torch.optim.AdamW, params, max_norm: float) -> torch.Tensor:
    """Clip the gradients by their global L2 norm (`max_norm` > 0; 0: no clipping), step, and return the norm.

    Same update as `clip_grad_norm_` then `step()`. With the fused AdamW the clip factor is not applied in a pass of its
    own: it goes to the kernel as the gradient scale (the kernel divides each gradient by it as it reads it, the hook
    `torch.amp.GradScaler` uses), which saves reading and writing every gradient once (~8 ms per step for 3.1B fp32
    parameters on an H100). The scale stays on the device: no host sync. Either way `.grad` holds the clipped
    gradients afterwards (the fused kernel writes the scaled ones back), as after `clip_grad_norm_`.
    """
    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    fused = optimizer.defaults.get("fused")
    optimizer.grad_scale = None
    if max_norm > 0:
        if fused:  # clip_grad_norm_'s factor max_norm / (norm + 1e-6) ≤ 1, as a divisor ≥ 1
            optimizer.grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0).to(torch.float32)
        else:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    optimizer.step()
    return norm


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
