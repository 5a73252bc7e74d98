"""The RL step's forward passes on a pipeline stage (`parallel.pp > 1`, or a whole model under `parallel.ep_overlap`),
through the pre-training pipeline schedules.

Each stage runs rl/folded.py's policy forward on the layers it owns: the micro-batch padded for sequence parallelism,
the replayed expert ids cut to the rank's token shard, and each of the stage's MoE layers taking the recorded row of
its layer id (rl/replay.py). Hidden states travel between stages as in pre-training (`pipeline.StageLink`; with
virtual stages, `parallel.pp_virtual`, each forward runs one of the stage's chunks and the schedules are the
interleaved ones). The last stage turns its logits into per-token log-probs under the rollout temperature
(vocab-parallel under TP):

- `pipeline_logprobs`: forward only (`pipeline.forward_only`, no autograd), for the old and reference log-probs (the
  reference model, `folded.frozen_copy` of the stage, runs it like the policy). They stay on the last stage: only its
  loss reads them.
- `pipeline_policy_backward`: 1F1B (`pipeline.one_f_one_b`) with the caller's policy loss of a micro-batch's log-probs
  as the last stage's loss (the schedule divides it by the step's response tokens before its backward). With `pairs`
  (`parallel.ep_overlap`) the schedule's units are pairs of micro-batches whose policy forwards run interleaved
  (parallel/micro_batch_pairs.py `pair_forward`, each one's replayed routing rebound at every switch:
  folded.PolicyBinding), one backward per pair, as in pre-training; an odd last micro-batch runs alone. Without
  pipeline stages this is plain accumulation over the pairs (one stage, as pre-training runs it).

With `pairs` the forward-only passes go in the same pairs (`pipeline.forward_only` moves them as its units), with no
backward: every pass, fillers included, then runs its micro-batches' expert all-to-alls in the same pairs on every
rank of an EP group, and each pair's transfers travel while the other micro-batch computes, as in the policy-loss pass.

The policy loss and its metric sums therefore exist on the last stage only; `rl_step` sums them over the pp group (the
other stages hold zeros), so every rank reports the same metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from services.trainer.parallel.groups import ParallelGroups
from services.trainer.parallel.micro_batch_pairs import pair_forward
from services.trainer.parallel.pipeline import StageForward, StageLink, UnitForward, forward_only, one_f_one_b
from services.trainer.rl.folded import (PolicyBinding, PolicyInput, logits_to_logprobs, policy_forward, policy_input,
                                        sp_size)


def _stage(model: nn.Module, micro_batches: list, layout: ParallelGroups) -> tuple[list[PolicyInput], StageLink]:
    inputs = [policy_input(model, mb) for mb in micro_batches]
    device = inputs[0].tokens.device if inputs else torch.device("cpu")
    link = StageLink.of(model, [p.tokens.shape[0] for p in inputs], device, layout.pp.group, sp_size(model))
    return inputs, link


def _stage_forward(model: nn.Module, inputs: list[PolicyInput], link: StageLink, autocast_dtype: torch.dtype | None,
                   last_stage: Callable[[int, torch.Tensor], torch.Tensor]) -> StageForward:
    """The policy forward of micro-batch i through one of this stage's chunks; for the model's last chunk,
    `last_stage(i, logits)` of its output."""

    def forward(i: int, hidden: torch.Tensor | None, chunk: int) -> torch.Tensor:
        p, layers = inputs[i], link.chunks[chunk]
        with policy_forward(model, p, autocast_dtype):
            out = model(p.tokens, p.position_ids, p.cu_seqlens, p.max_seqlen, hidden=hidden, layers=layers)
        return last_stage(i, out) if link.holds_loss(chunk) else out

    return forward


def _pair_forward(model: nn.Module, inputs: list[PolicyInput], link: StageLink, autocast_dtype: torch.dtype | None,
                  last_stage: Callable[[int, torch.Tensor], torch.Tensor]) -> UnitForward:
    """`_stage_forward` of a unit of micro-batches (a pair), their forwards interleaved (`pair_forward`)."""
    binding = PolicyBinding(model, inputs)

    def paused_forward(i: int, hidden: torch.Tensor | None, chunk: int, staged: bool = True):
        # a generator: the model's staged forward starts at its first resumption, once `binding` has bound input i
        p = inputs[i]
        out = yield from model(p.tokens, p.position_ids, p.cu_seqlens, p.max_seqlen, hidden=hidden,
                               layers=link.chunks[chunk], staged=True)
        if not link.holds_loss(chunk):
            return out
        with torch.autocast(p.tokens.device.type, enabled=False):  # as unpaired: the log-probs outside autocast
            return last_stage(i, out)

    def autocast():
        device = inputs[0].tokens.device
        return torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)

    pairs = pair_forward(paused_forward, autocast, binding.bind)

    def forward(unit: list[int], hiddens: list[torch.Tensor | None], chunk: int) -> list[torch.Tensor]:
        try:
            return pairs(unit, hiddens, chunk)
        finally:
            binding.release()

    return forward


def pipeline_logprobs(model: nn.Module, micro_batches: list, temperature: float, autocast_dtype: torch.dtype | None,
                      layout: ParallelGroups, pairs: bool = False) -> list[torch.Tensor | None]:
    """`step.token_logprobs` of every micro-batch through the pipeline, without gradients: [T] fp32 on the last stage
    (on each of its TP ranks), None on the other stages. With `pairs`, micro-batches go two at a time, interleaved
    (module docstring). Every stage of the pp group must call it."""
    inputs, link = _stage(model, micro_batches, layout)
    logprobs = lambda i, logits: logits_to_logprobs(model, logits, inputs[i], temperature)  # noqa: E731
    fwd = _stage_forward(model, inputs, link, autocast_dtype, logprobs)
    if not pairs:
        return forward_only(fwd, link)
    return forward_only(fwd, link, unit_forward=_pair_forward(model, inputs, link, autocast_dtype, logprobs),
                        unit_size=2)


def pipeline_policy_backward(model: nn.Module, micro_batches: list, policy_loss: Callable[[int, torch.Tensor], Any],
                             step_tokens: int, temperature: float, autocast_dtype: torch.dtype | None,
                             layout: ParallelGroups, pairs: bool = False) -> None:
    """Forward and backward of every micro-batch through the pipeline (1F1B); `policy_loss(i, logp)` is the summed
    policy loss of micro-batch i from its per-token log-probs [T] (called on the last stage only), each divided by
    `step_tokens` before its backward. With `pairs`, micro-batches go two at a time, interleaved (module docstring).
    Every stage of the pp group must call it."""
    inputs, link = _stage(model, micro_batches, layout)
    loss = lambda i, logits: policy_loss(i, logits_to_logprobs(model, logits, inputs[i], temperature))  # noqa: E731
    fwd = _stage_forward(model, inputs, link, autocast_dtype, loss)
    if not pairs:
        one_f_one_b(fwd, link, max(step_tokens, 1))
        return
    one_f_one_b(fwd, link, max(step_tokens, 1), unit_forward=_pair_forward(model, inputs, link, autocast_dtype, loss),
                unit_size=2)
