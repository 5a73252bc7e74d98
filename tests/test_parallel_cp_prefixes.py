"""Context parallelism's all-gather exchange on CUDA runs flash attention over key prefixes instead of masked SDPA.

Specification: for every rank of CP groups of 2 and 4 and packed micro-batches of many documents (some spanning
chunks), the (query segment, key prefix) pairs `key_prefixes` builds, each causal aligned at the bottom right, let a
query see exactly the keys `_visible` allows (same document, not in the future) and no other. On a GPU, attention
through them (`causal_gqa` with grouped K/V heads) equals fp32 attention under that mask, forward and backward, to bf16
rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.trainer.model.attention import document_ids
from services.trainer.parallel.context_parallel import CPLayout, _visible, key_prefixes


def packed_doc_ids(total: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(total - 1, generator=g)[:int(torch.randint(1, 12, (), generator=g))] + 1
    cu = torch.cat((torch.tensor([0]), cuts.sort().values, torch.tensor([total])))
    return document_ids(cu, total)


def prefix_mask(pre, rows_total: int) -> torch.Tensor:
    """[local queries, gathered keys] bool: what flash attention over the prefixes lets each query see."""
    n = int(pre.cu_q[-1])
    mask = torch.zeros(n, rows_total, dtype=torch.bool)
    for s in range(pre.cu_q.shape[0] - 1):
        q0, q1, k0, k1 = int(pre.cu_q[s]), int(pre.cu_q[s + 1]), int(pre.cu_k[s]), int(pre.cu_k[s + 1])
        for i in range(q1 - q0):
            seen = (k1 - k0) - (q1 - q0) + i + 1  # bottom-right causal alignment
            mask[q0 + i, pre.rows[k0:k0 + seen]] = True
    return mask


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_the_key_prefixes_show_each_query_exactly_the_keys_the_mask_allows(size, seed):
    doc_ids = packed_doc_ids(128, seed)
    for rank in range(size):
        layout = CPLayout(None, rank, size, doc_ids)
        want = torch.cat([_visible(layout, rank, r) for r in range(size)], dim=1)
        pre = key_prefixes(doc_ids, size, rank)
        assert torch.equal(prefix_mask(pre, doc_ids.shape[0]), want), (size, seed, rank)
        assert pre.max_q == int((pre.cu_q[1:] - pre.cu_q[:-1]).max())
        assert pre.max_k == int((pre.cu_k[1:] - pre.cu_k[:-1]).max())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention runs on CUDA only")
def test_flash_attention_over_the_prefixes_equals_masked_attention_on_cuda():
    from services.trainer.model.flash_varlen import causal_gqa

    torch.manual_seed(0)
    total, size, heads, kv_heads, d = 1024, 2, 8, 2, 64
    doc_ids = packed_doc_ids(total, 5)
    for rank in range(size):
        layout = CPLayout(None, rank, size, doc_ids)
        mask = torch.cat([_visible(layout, rank, r) for r in range(size)], dim=1).cuda()
        pre = key_prefixes(doc_ids, size, rank).to(torch.device("cuda"))
        q = torch.randn(total // size, heads, d, device="cuda", requires_grad=True)
        k = torch.randn(total, kv_heads, d, device="cuda", requires_grad=True)
        v = torch.randn(total, kv_heads, d, device="cuda", requires_grad=True)
        dout = torch.randn(total // size, heads, d, device="cuda")

        ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                             enable_gqa=True).transpose(0, 1)
        ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
        half = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
        out = causal_gqa(half[0], half[1][pre.rows], half[2][pre.rows], pre.cu_q, pre.max_q, pre.cu_k, pre.max_k)
        grads = torch.autograd.grad(out, half, dout.bfloat16())
        assert (out.float() - ref).abs().max() < 3e-2
        for g, r in zip(grads, ref_grads, strict=True):
            assert (g.float() - r).norm() / r.norm() < 2e-2
