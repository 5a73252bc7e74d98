"""AdamW with a linear-warmup + cosine schedule. Norm scales, biases and router bias are not weight-decayed.

One process: `MasterWeightAdamW`, one pass of kernels/adamw.py per parameter. With fp32 parameters they are their own
master weights; with `optimizer.param_dtype=bf16` the model holds bf16 parameters (no per-step weight casts under
autocast, bf16 gradients) and the optimizer the lower 16 bits of each fp32 master weight (the bf16 parameter holds
the upper 16) and the moments, all updated in the same pass. Several ranks: the distributed optimizer
(parallel/distributed_optimizer.py) does the same over its buckets.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn

from kernels.adamw import adamw_step, join_master, split_master
from services.common.config import OptimizerConfig


def lr_at(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """The learning rate of 0-based `step` of a run of `total_steps`: linear warmup to `cfg.lr`, then `cfg.decay`'s
    shape down to `cfg.min_lr`, which `total_steps` reaches (a function of the step alone: a resume follows it)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    after = total_steps - cfg.warmup_steps
    if cfg.decay == "constant":
        return cfg.lr
    if cfg.decay == "wsd":  # stable at lr, then the last decay_steps linear to min_lr
        decay = cfg.decay_steps or max(1, after // 5)
        progress = min(1.0, max(0.0, (step - (total_steps - decay)) / decay))
        return cfg.lr - (cfg.lr - cfg.min_lr) * progress
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, after))
    if cfg.decay == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * progress
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def stays_fp32(name: str, p: torch.Tensor) -> bool:
    """Parameters kept in fp32 under `optimizer.param_dtype=bf16`: the embedding (its output starts the residual
    stream, which then stays fp32 as with fp32 parameters under autocast), norm scales and router weights (fp32
    routing scores). Every matrix a GEMM reads in bf16 anyway is stored in bf16, so the forward pass computes exactly
    what it computes from fp32 parameters under bf16 autocast."""
    return p.ndim < 2 or name.endswith("router.weight") or name.endswith("embed.weight")


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW over fp32 master weights, for parameters held in fp32 (their own master weights) or in bf16 (Megatron's
    bf16 mixed precision with its precision-aware optimizer's `store_param_remainders`).

    At construction each parameter's current (fp32) value becomes its master weight: those in `keep_fp32` stay fp32
    and are their own master weight; every other one is re-stored as bf16, rounded to nearest, and the optimizer keeps
    only the int16 remainder that, joined with the bf16 bits, is the fp32 master exactly (kernels/adamw.py
    `split_master`): 2 B of master weight per parameter, not 4. The optimizer owns the parameters' precision from then on;
    write a value through `set_master`, never into a bf16 parameter alone (its remainder would no longer match).
    `step` reads the gradients and writes master weights, moments and the bf16 copies in one kernel per parameter.
    State per parameter, created here (so a checkpoint's buffers are known before the first step): `master` (fp32,
    the parameter itself) or `remainder` (int16), `exp_avg`, `exp_avg_sq` (`moment_dtype`; the kernel's math is fp32)
    and `step` (a host scalar). `master_value(p)` is the fp32 master either way; checkpoints save a kept parameter's
    `master` as its value, and a bf16 parameter as itself plus its `remainder` (services/trainer/checkpointing.py).

    Gradients: one backward per step leaves its bf16 gradient in `.grad` and the kernel reads it as is (no copy).
    From a step's second backward on (gradient accumulation), each backward's contribution is added into an fp32 sum
    before autograd could add it in bf16, and `.grad` is cleared: `grad(p)` is the step's gradient either way.
    Gradient clipping as with torch's fused AdamW: `grad_scale` (a device scalar, set by `clip_and_step`) divides
    every gradient as the kernel reads it; unlike torch's kernel, ours leaves the gradients unscaled.
    """

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 moment_dtype: torch.dtype = torch.float32, keep_fp32: tuple[torch.Tensor, ...] = ()):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        kept = {id(p) for p in keep_fp32}
        self.grad_scale: torch.Tensor | None = None
        self._backwards: dict[torch.Tensor, int] = {}  # backward passes that reached each parameter this step
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise ValueError(f"MasterWeightAdamW takes fp32 parameters (their values become the master "
                                     f"weights), got a {p.dtype} parameter of shape {tuple(p.shape)}")
                self.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                 "exp_avg": torch.zeros_like(p, dtype=moment_dtype),
                                 "exp_avg_sq": torch.zeros_like(p, dtype=moment_dtype)}
                if id(p) in kept:
                    self.state[p]["master"] = p.detach()
                    continue  # fp32: autograd sums its gradients in fp32 already
                p.data, self.state[p]["remainder"] = split_master(p.detach())
                # weak references only: a hook that held the optimizer would keep it (and the model) alive
                optimizer, param = weakref.ref(self), weakref.ref(p)
                p.register_hook(lambda g, o=optimizer, q=param: _call(o, "_sum_in_fp32", q(), g, default=g))
                p.register_post_accumulate_grad_hook(lambda q, o=optimizer: _call(o, "_clear_summed", q))

    def _sum_in_fp32(self, p: torch.Tensor, contribution: torch.Tensor) -> torch.Tensor:
        """Before autograd accumulates a backward's gradient: from the second one on, add it to the fp32 sum."""
        n = self._backwards[p] = self._backwards.get(p, 0) + 1
        if n > 1:
            state = self.state[p]
            total = state.get("grad_sum")
            if total is None:
                total = state["grad_sum"] = torch.empty_like(p, dtype=torch.float32)
            if n == 2:
                total.copy_(p.grad)
                p.grad = None  # so autograd stores this contribution as is, not adding it in bf16 only to be cleared
            total.add_(contribution)
        return contribution

    def _clear_summed(self, p: torch.Tensor) -> None:
        if self._backwards.get(p, 0) > 1:
            p.grad = None  # autograd's bf16 sum: the fp32 one is the gradient

    def master_value(self, p: torch.Tensor) -> torch.Tensor:
        """`p`'s fp32 master weight: the parameter itself when it is fp32, else joined from its bf16 bits and
        remainder (a new tensor)."""
        state = self.state[p]
        return state["master"] if "master" in state else join_master(p.detach(), state["remainder"])

    @torch.no_grad()
    def set_master(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """Set `p`'s fp32 master weight (a checkpoint's value): the parameter gets it rounded, the remainder the rest."""
        state = self.state[p]
        if "master" in state:
            state["master"].copy_(value)
        else:
            split_master(value.to(device=p.device, dtype=torch.float32).reshape(p.shape), p.data, state["remainder"])

    def grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The gradient this step will apply to `p`: `.grad`, or the fp32 sum over several backward passes."""
        return self.state[p]["grad_sum"] if self._backwards.get(p, 0) > 1 else p.grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._backwards.clear()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                grad = self.grad(p)
                if grad is None:
                    continue
                state = self.state[p]
                state["step"] += 1
                if "master" in state:  # fp32: the parameter is its own master weight
                    master, copy = state["master"], None
                else:  # bf16: the kernel joins the parameter with its remainder, updates and splits again
                    master, copy = state["remainder"], p
                adamw_step(master, grad.contiguous(), state["exp_avg"], state["exp_avg_sq"], copy,
                           lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                           weight_decay=group["weight_decay"], step=int(state["step"]), grad_divisor=self.grad_scale)
        return loss


def _call(ref: weakref.ref, method: str, *args, default=None):
    target = ref()
    return default if target is None else getattr(target, method)(*args)


def build_adamw(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer of one process: `optimizer.param_dtype=bf16` re-stores the model's parameters in bf16 (build it
    after the model holds its initial fp32 weights and sits on its device). With fp32 parameters it is the same
    kernel over parameters that are their own master weights: one pass that reads the gradient and writes the
    parameter and moments (on an H100 1.55x torch's fused AdamW, which also writes the clipped gradient back;
    bench/RESULTS.md)."""
    groups, betas = param_groups(model, cfg.weight_decay), (cfg.beta1, cfg.beta2)
    keep = tuple(p for n, p in model.named_parameters() if cfg.param_dtype == "fp32" or stays_fp32(n, p))
    return MasterWeightAdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             moment_dtype=DTYPES[cfg.moment_dtype], keep_fp32=keep)


def clip_and_step(optimizer: torch.optim.Optimizer, params, max_norm: float) -> torch.Tensor:
    """Clip the gradients by their global L2 norm (`max_norm` > 0; 0: no clipping), step, and return the norm.

    Same update as `clip_grad_norm_` then `step()`. With `MasterWeightAdamW` (the trainer's) the clip factor is not
    applied in a pass of its own: it goes to the kernel as the gradient divisor (`grad_scale`, applied as each
    gradient is read), which saves reading and writing every gradient once (~8 ms per step for 3.1B fp32 parameters
    on an H100), stays on the device (no host sync) and leaves the gradients unclipped. Any other optimizer (tests
    drive the RL step with SGD) gets its gradients clipped in place first.
    """
    params, master_weights = list(params), isinstance(optimizer, MasterWeightAdamW)
    grads = [optimizer.grad(p) if master_weights else p.grad for p in params]
    params, grads = [p for p, g in zip(params, grads) if g is not None], [g for g in grads if g is not None]
    norm = grad_norm(grads)
    if master_weights:
        # clip_grad_norm_'s factor max_norm / (norm + 1e-6) <= 1, as a divisor >= 1
        optimizer.grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0).to(torch.float32) if max_norm > 0 else None
    elif max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    optimizer.step()
    return norm


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm, accumulated in fp32 whatever the gradients' dtype (bf16 per-tensor norms would round)."""
    if all(g.dtype == torch.float32 for g in grads):
        return torch.nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
