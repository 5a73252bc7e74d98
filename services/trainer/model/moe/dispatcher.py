"""Token dispatch: permute routed tokens into expert order, and bring expert outputs back to their tokens.

`LocalDispatcher` is the single-process case (all experts here). Expert-parallel dispatchers (all-to-all, all-gather) in
`services/trainer/parallel/` implement the same two methods, so the MoE layer is unchanged under EP.

The router weight of each (token, slot) travels with the token and is folded into the expert's activation
(memory-efficient permutation), so `combine` is a plain scatter-add without a second T·k·h weighted buffer.

Two implementations of the local permutation, chosen by `fused` (config `model.moe_kernels: [permutation]`):
- the Triton kernels (`kernels/permute.py`, `kernels/unpermute.py`) on CUDA: a fixed buffer of T·k rows (dropped copies
  are zero rows past the last expert's), per-expert counts computed and kept on the device, so neither the dropless
  nor the capacity case makes the host wait;
- torch ops (`permute`/`unpermute` below, also used by the expert-parallel dispatchers): rows of dropped copies are
  removed, which needs their number on the host in the capacity case.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.trainer.model.moe.experts import triton_applies
from services.trainer.model.moe.router import Routing, expert_counts


@dataclass
class Dispatched:
    """Tokens in expert order for the experts held here."""

    hidden: torch.Tensor  # [N, h], grouped by local expert
    weights: torch.Tensor  # [N] router weight of each row
    tokens_per_expert: torch.Tensor  # [local experts] int64
    state: object  # whatever `combine` needs to undo the dispatch


def permute(hidden: torch.Tensor, routing: Routing, num_experts: int):
    """Sort kept (token, slot) pairs by expert (stable, so token order inside an expert is preserved)."""
    T, k = routing.expert_ids.shape
    flat_expert = routing.expert_ids.reshape(-1)
    flat_token = torch.arange(T, device=hidden.device).repeat_interleave(k)
    if routing.kept is None:  # dropless: sizes are known without asking the device
        order = torch.sort(flat_expert, stable=True).indices
        tokens_per_expert = expert_counts(flat_expert, num_experts)
    else:
        kept = routing.kept.reshape(-1)
        # Dropped slots sort past the last expert, so one stable sort both groups and removes them.
        sort_key = torch.where(kept, flat_expert, torch.full_like(flat_expert, num_experts))
        order = torch.sort(sort_key, stable=True).indices[: int(kept.sum())]
        tokens_per_expert = expert_counts(flat_expert, num_experts, kept)
    token_idx = flat_token[order]
    return hidden[token_idx], routing.weights.reshape(-1)[order], tokens_per_expert, token_idx


def unpermute(expert_out: torch.Tensor, token_idx: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sum each token's (already weighted) expert outputs back into its row; dropped slots contribute nothing."""
    out = expert_out.new_zeros(num_tokens, expert_out.shape[1])
    return out.index_add(0, token_idx, expert_out)


@dataclass
class _FusedState:
    row_id_map: torch.Tensor  # [T, k] int32 from kernels.permute


class LocalDispatcher:
    def __init__(self, num_experts: int, fused: bool = False):
        self.num_experts = num_experts
        self.fused = fused  # Triton permute/unpermute where they apply (CUDA, or the interpreter in tests)

    def dispatch(self, hidden: torch.Tensor, routing: Routing, in_flight=None) -> Dispatched:
        """`in_flight`: work an expert-parallel dispatcher runs while its tokens travel; here, with nothing in
        flight, it just runs first."""
        if in_flight is not None:
            in_flight()
        if self.fused and triton_applies(hidden):
            return self._dispatch_fused(hidden, routing)
        x, w, counts, token_idx = permute(hidden, routing, self.num_experts)
        return Dispatched(x, w, counts, (token_idx, hidden.shape[0]))

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        if isinstance(dispatched.state, _FusedState):
            from kernels.unpermute import unpermute as unpermute_rows

            return unpermute_rows(expert_out, dispatched.state.row_id_map)  # weights already folded in: a plain sum
        token_idx, num_tokens = dispatched.state
        return unpermute(expert_out, token_idx, num_tokens)

    def redispatch(self, hidden: torch.Tensor, state: object) -> torch.Tensor:
        """The rows of the dispatch whose `Dispatched.state` is given, again, from the same input, without autograd
        (`model.recompute: [moe_dispatch]` rebuilds them in backward instead of keeping them)."""
        with torch.no_grad():
            if isinstance(state, _FusedState):
                from kernels.permute import permute_rows_again

                return permute_rows_again(hidden, state.row_id_map)
            token_idx, _ = state
            return hidden[token_idx]

    def _dispatch_fused(self, hidden: torch.Tensor, routing: Routing) -> Dispatched:
        from kernels.permute import permute as permute_rows

        indices = routing.expert_ids
        if routing.kept is not None:  # a dropped copy is a negative index to the kernel
            indices = indices.masked_fill(~routing.kept, -1)
        perm = permute_rows(hidden, indices, self.num_experts, routing.weights)
        return Dispatched(perm.permuted, perm.permuted_probs, perm.tokens_per_expert, _FusedState(perm.row_id_map))
