"""Unpermute and combine: bring expert outputs back to token order, summing each token's k copies.

    unpermute(expert_out [T*k, h], row_id_map [T, k], probs [T, k] | None) -> [T, h]
    out[t] = sum over routed j of probs[t, j] * expert_out[row_id_map[t, j]]

`row_id_map` is the one `permute` returned (dropped copies, negative entries, contribute nothing); `padded=True` for a
capacity layout (`permute(..., capacity=c)`: expert_out has E*c rows, and backward leaves zero gradient on its padding
rows). With
memory-efficient permutation the probabilities were already folded into the expert activation (`swiglu_prob`), and
`probs=None` makes this a plain sum. The sum is accumulated in fp32 and rounded once to expert_out's dtype.

Backward, one program per token: grad_expert_out[row(t, j)] = probs[t, j] * grad_out[t] (zeros on dropped rows), and
grad_probs[t, j] = <grad_out[t], expert_out[row(t, j)]>, the two sharing the load of grad_out[t].
"""

from __future__ import annotations

import torch

from kernels._rows import gather_rows, scatter_rows
from kernels._triton import use_triton


def _check(expert_out: torch.Tensor, row_id_map: torch.Tensor, probs: torch.Tensor | None,
           padded: bool = False) -> None:
    if expert_out.dim() != 2 or row_id_map.dim() != 2:
        raise ValueError(f"unpermute wants expert_out [T*k, h] and row_id_map [T, k]; got {tuple(expert_out.shape)} "
                         f"and {tuple(row_id_map.shape)}")
    if not padded and expert_out.shape[0] != row_id_map.numel():
        raise ValueError(f"expert_out has {expert_out.shape[0]} rows but row_id_map {tuple(row_id_map.shape)} "
                         f"addresses {row_id_map.numel()}: pass the full permuted buffer that permute produced")
    if row_id_map.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"row_id_map must be int32 or int64 (as permute returns it), got {row_id_map.dtype}")
    if probs is not None and probs.shape != row_id_map.shape:
        raise ValueError(f"probs {tuple(probs.shape)} must have the shape of row_id_map {tuple(row_id_map.shape)}")


def unpermute_reference(expert_out: torch.Tensor, row_id_map: torch.Tensor,
                        probs: torch.Tensor | None = None, padded: bool = False) -> torch.Tensor:
    """Same contract as `unpermute`, in plain (differentiable) torch ops."""
    _check(expert_out, row_id_map, probs, padded)
    T, k = row_id_map.shape
    flat = row_id_map.reshape(-1).long()
    routed = flat >= 0
    rows = torch.where(routed, flat, 0 if padded else -flat - 1)  # a padded layout's dropped copy has no row
    copies = expert_out.index_select(0, rows).float() * routed.unsqueeze(1)  # [T*k, h]
    if probs is not None:
        copies = copies * probs.reshape(-1, 1).float()
    return copies.view(T, k, -1).sum(1).to(expert_out.dtype)


class _UnpermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, row_id_map, probs, padded):
        ctx.rows = expert_out.shape[0] if padded else None  # backward: a zeroed buffer, the padding rows left at 0
        expert_out = expert_out.contiguous()
        probs = probs.contiguous() if probs is not None else None
        # expert_out is kept only for the probs gradient: the memory-efficient path (probs=None) must not pin it.
        needs_dots = probs is not None and ctx.needs_input_grad[2]
        ctx.save_for_backward(expert_out if needs_dots else None, row_id_map, probs)
        return gather_rows(expert_out, row_id_map, probs)

    @staticmethod
    def backward(ctx, grad_out):
        expert_out, row_id_map, probs = ctx.saved_tensors
        want_probs = expert_out is not None
        grad_expert_out, dots = scatter_rows(grad_out.contiguous(), row_id_map, probs,
                                             dot_src=expert_out if want_probs else None, rows=ctx.rows)
        grad_probs = dots.to(probs.dtype) if want_probs else None
        return grad_expert_out, None, grad_probs, None


def unpermute(expert_out: torch.Tensor, row_id_map: torch.Tensor, probs: torch.Tensor | None = None,
              padded: bool = False) -> torch.Tensor:
    """Combine each token's expert outputs (see the module docstring). Triton on CUDA, the torch reference on CPU."""
    _check(expert_out, row_id_map, probs, padded)
    if not use_triton(expert_out):
        return unpermute_reference(expert_out, row_id_map, probs, padded)
    return _UnpermuteFunction.apply(expert_out, row_id_map.contiguous(), probs, padded)
