"""Causal attention over packed documents with fewer K/V heads than query heads, on FlashAttention-2's varlen kernels.

torch.nn.attention.varlen.varlen_attn runs the same kernels (aten::_flash_attention_forward / _backward), which take
grouped-query heads as they are (query heads a multiple of K/V heads). Its `enable_gqa` argument arrived after torch
2.11, though, and there K/V had to be repeated to the query's head count first: a [T, Hq, d] copy of each in forward
and a reduction of their gradients in backward (0.84 ms of a 90 ms step at the 4-layer Qwen3-30B-A3B shape on an
H100, 32 query and 4 K/V heads; bench/RESULTS.md). `causal_gqa` calls the kernels directly for that case; where
varlen_attn has `enable_gqa`, attention.py uses the library.
"""

from __future__ import annotations

import torch


class _CausalVarlenFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng_state, unused)
        ctx.max_q, ctx.max_k = max_q, max_k
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_q, cu_k, rng_state, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu_q, cu_k, ctx.max_q, ctx.max_k, 0.0, True, rng_state, unused)
        return dq, dk, dv, None, None, None, None


def causal_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
               cu_seqlens_k: torch.Tensor | None = None, max_seqlen_k: int | None = None) -> torch.Tensor:
    """q [Tq, Hq, d], k/v [Tk, Hkv, d] (CUDA, bf16/fp16, Hq a multiple of Hkv), `cu_seqlens` int32 [segments + 1] ->
    [Tq, Hq, d], causal inside each segment. With `cu_seqlens_k` (and `max_seqlen_k`) a segment's keys are their own
    segments, and a segment of n queries against m keys is aligned at the bottom right: its query i sees keys up to
    m - n + i (the queries are the last n of the m positions; context parallelism's key prefixes)."""
    if q.shape[1] % k.shape[1] or k.shape != v.shape:
        raise ValueError(f"causal_gqa: query heads ({q.shape[1]}) must be a multiple of K/V heads ({k.shape[1]}), "
                         f"and k {tuple(k.shape)} must match v {tuple(v.shape)}")
    if cu_seqlens_k is None:
        cu_seqlens_k, max_seqlen_k = cu_seqlens, max_seqlen
    return _CausalVarlenFlash.apply(q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k)
