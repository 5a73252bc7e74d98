"""Grouped-query heads straight into FlashAttention-2's varlen kernels (services/trainer/model/flash_varlen.py) give
what the masked SDPA reference gives, forward and backward, without repeating K/V (CUDA only: the kernels exist
there; on CPU the model runs the SDPA path these tests compare against)."""

from __future__ import annotations

import pytest
import torch

from services.trainer.model.attention import packed_causal_attention
from services.trainer.model.flash_varlen import causal_gqa

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention's varlen kernels run on CUDA")


def packed(heads_q: int, heads_kv: int, lengths: list[int], d: int = 64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k, v = (torch.randn(T, h, d, generator=gen) for h in (heads_q, heads_kv, heads_kv))
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return q, k, v, cu


def masked_reference(q, k, v, cu):
    """The CPU path of packed_causal_attention (fp32 SDPA with a document-causal mask)."""
    return packed_causal_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), cu.cpu())


@cuda_only
@pytest.mark.parametrize("heads_q,heads_kv", [(8, 2), (8, 8), (6, 1)])
def test_output_and_gradients_match_the_masked_reference(heads_q, heads_kv):
    q, k, v, cu = packed(heads_q, heads_kv, [100, 37, 250, 1])
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = masked_reference(*ref, cu)
    out_ref.backward(grad_out)
    ours = [t.cuda().bfloat16().requires_grad_() for t in (q, k, v)]
    out = causal_gqa(*ours, cu.cuda(), 250)
    out.backward(grad_out.cuda().bfloat16())
    # bf16 inputs and outputs against fp32 math: a few bf16 ulps
    torch.testing.assert_close(out.float().cpu(), out_ref.detach(), rtol=2e-2, atol=2e-2)
    for mine, theirs in zip(ours, ref):
        assert mine.grad.shape == theirs.shape  # K/V gradients come back per K/V head, not per query head
        torch.testing.assert_close(mine.grad.float().cpu(), theirs.grad, rtol=3e-2, atol=3e-2)


@cuda_only
def test_equal_to_repeating_kv_heads_through_torch_varlen_attn():
    from torch.nn.attention.varlen import varlen_attn

    q, k, v, cu = packed(8, 2, [300, 212])
    q, k, v, cu = (t.cuda() for t in (q, k, v, cu))
    a = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    b = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    out_a = causal_gqa(*a, cu, 300)
    kr, vr = (t.repeat_interleave(4, dim=1) for t in b[1:])
    out_b = varlen_attn(b[0], kr, vr, cu, cu, 300, 300, window_size=(-1, 0))
    g = torch.randn_like(out_a)
    out_a.backward(g)
    out_b.backward(g)
    # The same kernels over the same values, but grouped heads take other tiles and loop orders than repeated ones:
    # equal up to bf16 rounding.
    for x, y in [(out_a, out_b)] + [(p.grad, q.grad) for p, q in zip(a, b)]:
        torch.testing.assert_close(x.float(), y.float(), rtol=1e-2, atol=1e-2)


def test_head_counts_that_do_not_divide_are_refused():
    q, k, v, cu = packed(6, 4, [10])
    with pytest.raises(ValueError, match="multiple of K/V heads"):
        causal_gqa(q, k, v, cu, 10)
