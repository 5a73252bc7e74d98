"""Token dispatch: permute routed tokens into expert order, and bring expert outputs back to their tokens.

`LocalDispatcher` is the single-process case (all experts here). Expert-parallel dispatchers (all-to-all, all-gather) in
`services/trainer/parallel/` implement the same two methods, so the MoE layer is unchanged under EP.

The router weight of each (token, slot) travels with the token and is folded into the expert's activation
(memory-efficient permutation), so `combine` is a plain scatter-add without a second T·k·h weighted buffer.

Two implementations of the permutation (`permute_by_expert` / `unpermute_by_token`, which the all-to-all expert-parallel
dispatcher uses too), chosen by `fused` (config `model.moe_kernels: [permutation]`):
- the Triton kernels (`kernels/permute.py`, `kernels/unpermute.py`) on CUDA: a fixed buffer of T·k rows (dropped copies
  are zero rows past the last expert's), per-expert counts computed and kept on the device, so neither the dropless
  nor the capacity case makes the host wait; with pad-to-capacity, E blocks of capacity rows (below);
- torch ops (`permute`/`unpermute`/`permute_padded` below; also the all-gather dispatcher's): rows of dropped copies
  are removed, which needs their number on the host in the capacity case.

Pad-to-capacity (`model.pad_to_capacity`, with a capacity factor; Megatron-Core's moe_pad_expert_input_to_capacity):
`permute_padded` gives every expert exactly its capacity of rows — its kept copies, then zero rows of router weight 0 —
so every size (the grouped GEMM's groups, the expert-parallel all-to-all's splits) is known on the host from the
config and the token count: nothing waits for the device to count. A padding row is a copy of a zero row appended to
the input, and `unpermute(..., padded=True)` sums its output into a spare row that it drops: it reaches no output and,
through it, no gradient. The Triton permutation lays out the same rows (`kernels.permute.permute(..., capacity=)`:
padding rows zero, weight 0, no slot's; their output reaches no token and their gradient is zero).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


def permute_padded(hidden: torch.Tensor, routing: Routing, num_experts: int):
    """As `permute`, with every expert's rows padded to `routing.capacity` (the kept copies never exceed it): returns
    the [E·capacity, h] rows, their weights (0 on padding), the counts (capacity each, made on the device without
    reading anything back) and the token of each row, T (the zero row `with_zero_row` appends) on padding."""
    T, k = routing.expert_ids.shape
    E, capacity = num_experts, routing.capacity
    flat_expert = routing.expert_ids.reshape(-1)
    kept = routing.kept.reshape(-1)
    sort_key = torch.where(kept, flat_expert, torch.full_like(flat_expert, E))  # dropped copies sort last
    order = torch.sort(sort_key, stable=True).indices
    expert = sort_key[order]
    counts = expert_counts(flat_expert, E, kept)
    first = F.pad(counts.cumsum(0) - counts, (0, 1))  # where each expert's copies start in `order` (dropped: any)
    place = torch.arange(T * k, device=hidden.device) - first[expert]  # index among its expert's kept copies
    row = torch.where(expert < E, expert * capacity + place, E * capacity)  # dropped: a spare row, cut off below
    # The slot each row holds; T·k (one past the last slot) on padding rows, whose token is then T·k // k = T.
    slot_of_row = torch.full((E * capacity + 1,), T * k, dtype=order.dtype, device=hidden.device)
    slot_of_row = slot_of_row.scatter_(0, row, order)[:-1]
    token_of_row = slot_of_row // k
    weights = F.pad(routing.weights.reshape(-1), (0, 1))[slot_of_row]  # padding rows: weight 0
    tokens_per_expert = torch.full((E,), capacity, dtype=torch.int64, device=hidden.device)
    return with_zero_row(hidden)[token_of_row], weights, tokens_per_expert, token_of_row


def with_zero_row(hidden: torch.Tensor) -> torch.Tensor:
    """[T + 1, h]: the padding rows' source."""
    return F.pad(hidden, (0, 0, 0, 1))


def unpermute(expert_out: torch.Tensor, token_idx: torch.Tensor, num_tokens: int, padded: bool = False) -> torch.Tensor:
    """Sum each token's (already weighted) expert outputs back into its row; dropped slots contribute nothing.
    `padded` (rows of `permute_padded`): the padding rows' outputs go to a spare row, dropped."""
    out = expert_out.new_zeros(num_tokens + padded, expert_out.shape[1])
    out = out.index_add(0, token_idx, expert_out)
    return out[:num_tokens] if padded else out


@dataclass
class _FusedState:
    row_id_map: torch.Tensor  # [T, k] int32 from kernels.permute
    padded_rows: int | None = None  # pad-to-capacity: the buffer's E·capacity rows


class LocalDispatcher:
    def __init__(self, num_experts: int, fused: bool = False):
        self.num_experts = num_experts
        self.fused = fused  # Triton permute/unpermute where they apply (CUDA, or the interpreter in tests)

    def dispatch(self, hidden: torch.Tensor, routing: Routing, in_flight=None) -> Dispatched:
        """`in_flight`: work an expert-parallel dispatcher runs while its tokens travel; here, with nothing in
        flight, it just runs first."""
        if in_flight is not None:
            in_flight()
        return Dispatched(*permute_by_expert(hidden, routing, self.num_experts, self.fused))

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        return unpermute_by_token(expert_out, dispatched.state)

    def redispatch(self, hidden: torch.Tensor, state: object) -> torch.Tensor:
        """The rows of the dispatch whose `Dispatched.state` is given, again, from the same input, without autograd
        (`model.recompute: [moe_dispatch]` rebuilds them in backward instead of keeping them)."""
        with torch.no_grad():
            if isinstance(state, _FusedState):
                from kernels.permute import permute_rows_again

                return permute_rows_again(hidden, state.row_id_map, state.padded_rows)
            token_idx, _, padded = state
            return (with_zero_row(hidden) if padded else hidden)[token_idx]



def permute_by_expert(hidden: torch.Tensor, routing: Routing, num_experts: int, fused: bool):
    """(rows grouped by expert, their router weights, tokens per expert, the state `unpermute_by_token` undoes it
    with): the Triton permutation where it applies (`fused`), else torch ops. Dropped copies: zero rows past the last
    expert's (Triton; their number is not known on the host), no rows (torch), or with pad-to-capacity no rows and
    every expert padded to its capacity (both)."""
    padded = routing.capacity is not None
    if fused and triton_applies(hidden):
        from kernels.permute import permute as permute_rows

        indices = routing.expert_ids
        if routing.kept is not None:  # a dropped copy is a negative index to the kernel
            indices = indices.masked_fill(~routing.kept, -1)
        perm = permute_rows(hidden, indices, num_experts, routing.weights, capacity=routing.capacity)
        state = _FusedState(perm.row_id_map, num_experts * routing.capacity if padded else None)
        return perm.permuted, perm.permuted_probs, perm.tokens_per_expert, state
    x, w, counts, token_idx = (permute_padded if padded else permute)(hidden, routing, num_experts)
    return x, w, counts, (token_idx, hidden.shape[0], padded)


def unpermute_by_token(expert_out: torch.Tensor, state: object) -> torch.Tensor:
    """Each token's (already weighted) expert outputs summed back into its row; `state` from `permute_by_expert`."""
    if isinstance(state, _FusedState):
        from kernels.unpermute import unpermute as unpermute_rows

        # weights already folded in: a plain sum
        return unpermute_rows(expert_out, state.row_id_map, padded=state.padded_rows is not None)
    token_idx, num_tokens, padded = state
    return unpermute(expert_out, token_idx, num_tokens, padded)
