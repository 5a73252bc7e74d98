"""`parallel.ep_overlap`: micro-batches in pairs, each pair through one interleaved forward and one backward, so that
one micro-batch's expert all-to-all is in flight while the other one computes.

With a, b the pair's micro-batches, each MoE layer's forward runs (services/trainer/model/stages.py pauses a forward
right after it launches a transfer):

    a: attention, router, permute, launch counts exchange
    b: attention, router, permute, launch counts exchange    (a's host thread waits for a's counts while b's work runs)
    a: launch dispatch                                  ─┐ a's tokens travel
    b: launch dispatch                                   │ b's tokens travel
    a: land dispatch, experts, launch combine            │ a's outputs travel
    b: land dispatch, experts, launch combine            │ b's outputs travel
    a: land combine, next layer's attention, ...        ─┘

One backward runs for the pair (from both losses, or on an inner pipeline stage from both output gradients); autograd
runs the nodes newest first, which is the same interleaving mirrored: each gradient transfer is launched
(`_Land.backward`) before the other micro-batch's backward work and waited for (`_Launch.backward`) after it. Under
pipeline parallelism the 1F1B schedule (`pipeline.one_f_one_b`) moves pairs as its units (with virtual stages, a pair
goes through each of the stage's chunks together).

The step is the same as without pairing: each micro-batch keeps its own routing, aux statistics and loss, and
gradients are summed. The price is two micro-batches' activations alive at once. An odd last micro-batch runs alone.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from services.trainer.model.stages import interleave
from services.trainer.parallel.context_parallel import bind_micro_batch

if TYPE_CHECKING:
    from services.trainer.parallel.pipeline import UnitForward


def backward_passes(num_micro_batches: int) -> int:
    """Backward passes of a step of `num_micro_batches` (the distributed optimizer reduces after the last one)."""
    return (num_micro_batches + 1) // 2


def pair_forward(model_stage: nn.Module, micro_batches: list[dict], stage_forward, autocast) -> UnitForward:
    """The pipeline schedule's forward of a unit of micro-batches through one of the stage's chunks
    (`pipeline.one_f_one_b`, unit size 2): each one's `stage_forward(i, hidden, chunk, staged=True)` generator, advanced
    in turn (a lone last micro-batch simply runs alone)."""

    def forward(unit: list[int], hiddens: list[torch.Tensor | None], chunk: int) -> list[torch.Tensor]:
        with autocast():
            # stage_forward binds its micro-batch's context-parallel layout when called; the modules read it while the
            # forward runs, so every switch rebinds it (only when some micro-batch has one: it walks the modules).
            forwards = [stage_forward(i, h, chunk, staged=True) for i, h in zip(unit, hiddens)]
            cp = any(micro_batches[i].get("cp_layout") is not None for i in unit)
            rebind = [partial(bind_micro_batch, model_stage, micro_batches[i]) for i in unit] if cp else None
            return interleave(forwards, rebind)

    return forward
