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

Pre-training (`pipeline.forward_backward_pipeline`) and RL (rl/pipelined.py: the policy loss's
`pipeline_policy_backward`, and the old and reference log-probs' forward-only `pipeline_logprobs`, which pair the same
micro-batches with no backward; each one's replayed routing rebound at every switch: rl/folded.py `PolicyBinding`)
pair through `pair_forward`.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Callable

import torch

from services.trainer.model.stages import interleave

if TYPE_CHECKING:
    from services.trainer.parallel.pipeline import UnitForward


def backward_passes(num_micro_batches: int) -> int:
    """Backward passes of a step of `num_micro_batches` (the distributed optimizer reduces after the last one)."""
    return (num_micro_batches + 1) // 2


def pair_forward(stage_forward, autocast, rebind: Callable[[int], None] | None = None) -> UnitForward:
    """The pipeline schedule's forward of a unit of micro-batches through one of the stage's chunks
    (`pipeline.one_f_one_b`, unit size 2): each one's `stage_forward(i, hidden, chunk, staged=True)` generator, advanced
    in turn (a lone last micro-batch simply runs alone). The modules read per-micro-batch state set on them (a
    context-parallel layout; RL's replayed expert ids) while a forward runs, so `rebind(i)`, where given, sets
    micro-batch i's before every resumption of its forward."""

    def forward(unit: list[int], hiddens: list[torch.Tensor | None], chunk: int) -> list[torch.Tensor]:
        with autocast():
            forwards = [stage_forward(i, h, chunk, staged=True) for i, h in zip(unit, hiddens)]
            return interleave(forwards, None if rebind is None else [partial(rebind, i) for i in unit])

    return forward
