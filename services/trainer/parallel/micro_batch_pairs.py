"""`parallel.ep_overlap`: micro-batches in pairs, each pair through one interleaved forward and one backward, so that
one micro-batch's expert all-to-all is in flight while the other one computes.

With a, b the pair's micro-batches, each MoE layer's forward runs (services/trainer/model/stages.py pauses a forward
right after it launches a transfer):

    a: attention, router, permute, launch dispatch  ─┐ a's tokens travel
    b: attention, router, permute, launch dispatch   │ b's tokens travel
    a: land dispatch, experts, launch combine        │ a's outputs travel
    b: land dispatch, experts, launch combine        │ b's outputs travel
    a: land combine, next layer's attention, ...    ─┘

Backward starts once, from the sum of both losses; autograd runs the nodes newest first, which is the same
interleaving mirrored: each gradient transfer is launched (`_Land.backward`) before the other micro-batch's backward
work and waited for (`_Launch.backward`) after it.

The step is the same as without pairing: each micro-batch keeps its own routing, aux statistics and loss, and
gradients are summed. The price is two micro-batches' activations alive at once. An odd last micro-batch runs alone.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from services.trainer.model.stages import interleave
from services.trainer.parallel.context_parallel import bind_micro_batch
from services.trainer.step import to_device


def backward_passes(num_micro_batches: int) -> int:
    """Backward passes of a step of `num_micro_batches` (the distributed optimizer reduces after the last one)."""
    return (num_micro_batches + 1) // 2


def forward_backward_pairs(model: nn.Module, micro_batches: list[dict[str, torch.Tensor]], step_tokens: int,
                           device: torch.device, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """`step.forward_backward` with the micro-batches taken two at a time (already CP-sharded); returns this rank's
    summed token loss (detached, fp32)."""
    total = torch.zeros((), device=device)
    for i in range(0, len(micro_batches), 2):
        pair = [to_device(mb, device) for mb in micro_batches[i:i + 2]]
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            forwards = [model(mb["tokens"], mb["position_ids"], mb["cu_seqlens"], mb.get("max_seqlen"),
                              labels=mb["labels"], staged=True) for mb in pair]
            # Context-parallel cores and routers read the micro-batch's layout from the module: rebind on every switch.
            cp = any(mb.get("cp_layout") is not None for mb in pair)
            losses = interleave(forwards, [partial(bind_micro_batch, model, mb) for mb in pair] if cp else None)
        loss = sum(losses)
        (loss / step_tokens).backward()
        total += loss.detach()
    return total
