"""The MoE FFN: route -> dispatch (permute) -> experts -> combine (unpermute) [+ shared expert, optionally gated]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.common.config import ModelConfig
from services.trainer.model import recompute
from services.trainer.model.mlp import SwiGLUMLP
from services.trainer.model.moe.dispatcher import LocalDispatcher
from services.trainer.model.moe.experts import GroupedExperts
from services.trainer.model.moe.router import Router
from services.trainer.model.precision import to_compute_dtype
from services.trainer.model.stages import Stages, run_to_end


class AttachAuxLoss(torch.autograd.Function):
    """Returns `x` unchanged; in backward, gives `aux_loss` a gradient of `scale`.

    This lets the aux loss join the backward pass from inside the layer, so it needs no plumbing to the loss and stays
    correct under pipeline parallelism (the loss lives on the last stage, the router may not).
    `scale`: a number, or a 0-d tensor on the device when the scale is only known there (the folded step's
    1 / micro-batches, all-reduced: reading it back would make the host wait for the device).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux_loss: torch.Tensor, scale: float | torch.Tensor):
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # a fill times the scale: a number joins as a kernel argument, where torch.as_tensor(number, device=...) would
        # copy it from pageable host memory and make the host wait for the device
        return grad, torch.ones((), dtype=torch.float32, device=grad.device) * ctx.scale, None


class MoELayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_ffn_hidden_size,
                                      fused_activation="activation" in cfg.moe_kernels, fp8=cfg.fp8)
        self.shared_expert = (SwiGLUMLP(cfg.hidden_size, cfg.shared_expert_ffn_hidden_size, fp8=cfg.fp8)
                              if cfg.shared_expert_ffn_hidden_size else None)
        # `model.shared_expert_gate` (Qwen2-MoE): the shared expert's output times sigmoid(x . w), per token
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if cfg.shared_expert_gate else None
        # Replaced by an EP dispatcher when parallelized.
        self.dispatcher = LocalDispatcher(cfg.num_experts, fused="permutation" in cfg.moe_kernels)
        self.aux_loss_scale = 1.0  # the training loop sets 1/num_micro_batches so aux gradients average like the loss
        # `model.recompute: [moe_dispatch]` (set by recompute.apply_memory_policy): the experts' first GEMM does not
        # keep the dispatched [T·k, h] rows for backward; they are permuted again from the [T, h] input when needed.
        self.recompute_dispatch = False
        self.last_aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor, segment_ids: torch.Tensor | None = None, staged: bool = False):
        """x: [T, h] -> [T, h]. With `staged`, a generator that pauses while its all-to-alls are in flight
        (services/trainer/model/stages.py) and returns the output."""
        stages = self._stages(x, segment_ids)
        return stages if staged else run_to_end(stages)

    def _stages(self, x: torch.Tensor, segment_ids: torch.Tensor | None) -> Stages[torch.Tensor]:
        routing = self.router(x, segment_ids)  # from x as it comes: the router scores in fp32
        # The experts compute in the autocast dtype: cast before the T·k-row copy, not after (half the bytes moved and
        # kept; the values the GEMMs see are the same).
        # The shared expert runs while the dispatch's all-to-all is in flight (forward and backward; EP only).
        shared: list[torch.Tensor] = []
        run_shared = (lambda: shared.append(self._shared(x))) if self.shared_expert is not None else None
        hidden = to_compute_dtype(x)
        dispatched = yield from _staged(self.dispatcher, "dispatch", hidden, routing, in_flight=run_shared)
        expert_out = self._experts(hidden, dispatched)
        out = (yield from _staged(self.dispatcher, "combine", expert_out, dispatched)).to(x.dtype)
        if shared:
            out = out + shared[0]
        self.last_aux_loss = routing.aux_loss.detach()
        if routing.aux_loss.requires_grad:
            out = AttachAuxLoss.apply(out, routing.aux_loss, self.aux_loss_scale)
        return out

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared_expert(x)
        if self.shared_expert_gate is None:
            return out
        # the gate's logit from x as it comes (as the router's scores), the product in the expert output's dtype
        return out * torch.sigmoid(F.linear(x, self.shared_expert_gate.weight.to(x.dtype))).to(out.dtype)

    def _experts(self, hidden: torch.Tensor, dispatched) -> torch.Tensor:
        run = lambda: self.experts(dispatched.hidden, dispatched.tokens_per_expert, dispatched.weights)  # noqa: E731
        if not (self.recompute_dispatch and torch.is_grad_enabled()):
            return run()
        # k copies of each token are kept as the recipe's one [T, h] input (which the layer keeps anyway, or nearly:
        # the router and the norm keep x, this is its compute-dtype copy).
        state = dispatched.state  # the recipe must not hold `dispatched`, which holds the rows it frees
        recompute.discard_output(dispatched.hidden, lambda: self.dispatcher.redispatch(hidden, state))
        with recompute.dropping_discarded():
            return run()


def _staged(dispatcher, method: str, *args, **kwargs) -> Stages:
    """`dispatcher.<method>_stages(...)` where the dispatcher can pause (expert-parallel all-to-all), else the plain
    call."""
    staged = getattr(dispatcher, method + "_stages", None)
    if staged is not None:
        return (yield from staged(*args, **kwargs))
    return getattr(dispatcher, method)(*args, **kwargs)
