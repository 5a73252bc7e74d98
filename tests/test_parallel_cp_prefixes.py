"""Context parallelism's all-gather exchange on CUDA runs flash attention over key prefixes instead of masked SDPA.

Specification: for every rank of CP groups of 2 and 4 and packed micro-batches of many documents (some spanning
chunks), the (query segment, key prefix) pairs `key_prefixes` builds, each causal aligned at the bottom right, let a
query see exactly the keys `_visible` allows (same document, not in the future) and no other. On a GPU, attention
through them (`causal_gqa` with grouped K/V heads) equals fp32 attention under that mask, forward and backward, to bf16
rounding. The prefixes are built only where that path runs (CUDA, 16 bits, values as wide as keys), once per
micro-batch and from the host's document ids; everywhere else the exchange takes masked SDPA and never builds them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from services.trainer.model.attention import document_ids
from services.trainer.parallel import context_parallel as cp
from services.trainer.parallel.context_parallel import (CPLayout, ContextParallelAttention, _flash_runs,
                                                        _visible, key_prefixes, shard_micro_batch)
from services.trainer.parallel.groups import Axis


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


def sharded(total: int, size: int, rank: int, seed: int) -> dict:
    """Rank `rank`'s share of a packed micro-batch, sharded for the all-gather exchange (no process group needed)."""
    doc_ids = packed_doc_ids(total, seed)
    cu = torch.cat((torch.tensor([0]), (doc_ids[1:] != doc_ids[:-1]).nonzero().flatten() + 1, torch.tensor([total])))
    tokens = torch.arange(total)
    mb = {"tokens": tokens, "labels": tokens, "position_ids": tokens, "cu_seqlens": cu.int()}
    return shard_micro_batch(mb, SimpleNamespace(cp=Axis("cp", None, tuple(range(size)), rank)), "allgather")


def attention_inputs(layout: CPLayout, heads: int, kv_heads: int, d: int, dv: int, dtype: torch.dtype, monkeypatch,
                     device: str = "cpu"):
    """The rank's q, k, v; the all-gather is stood in for by the other ranks' zigzag shards of the same K/V."""
    gen = torch.Generator().manual_seed(1)
    k_full = torch.randn(layout.total, kv_heads, d, generator=gen).to(device, dtype)
    v_full = torch.randn(layout.total, kv_heads, dv, generator=gen).to(device, dtype)
    q = torch.randn(layout.total // layout.size, heads, d, generator=gen).to(device, dtype)
    rows, mine = torch.cat([layout.index(r) for r in range(layout.size)]), layout.index(layout.rank)
    k, v = k_full[mine], v_full[mine]
    gathered = {id(k): k_full[rows], id(v): v_full[rows]}
    monkeypatch.setattr(cp, "gather_tokens", lambda x, group: gathered[id(x)])
    return q, k, v


def test_the_flash_path_is_cuda_attention_in_16_bits_with_values_as_wide_as_keys():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert _flash_runs(cuda, torch.bfloat16, 64, 64)
    assert _flash_runs(cuda, torch.float16, 64, 64)
    assert not _flash_runs(cuda, torch.float32, 64, 64)  # fp32: SDPA
    assert not _flash_runs(cuda, torch.bfloat16, 192, 128)  # MLA's narrower values: SDPA
    assert not _flash_runs(cpu, torch.bfloat16, 64, 64)


@pytest.mark.parametrize("dtype, dv", [(torch.float32, 16), (torch.bfloat16, 16), (torch.bfloat16, 8)])
def test_the_allgather_exchange_off_the_flash_path_never_builds_key_prefixes(monkeypatch, dtype, dv):
    def refuse(*args):
        raise AssertionError("key_prefixes built for a micro-batch whose attention does not use them")

    monkeypatch.setattr(cp, "key_prefixes", refuse)
    local = sharded(64, 2, 1, seed=3)
    core = ContextParallelAttention()
    core.layout = local["cp_layout"].to(torch.device("cpu"))
    q, k, v = attention_inputs(core.layout, 4, 2, 16, dv, dtype, monkeypatch)
    out = core(q, k, v, local["cu_seqlens"])
    assert out.shape == (32, 4, dv) and torch.isfinite(out.float()).all()


def test_the_flash_path_builds_the_key_prefixes_once_per_micro_batch_and_attends_as_the_mask_does(monkeypatch):
    """The flash branch forced on the CPU, with a plain-torch `causal_gqa` (segments aligned at the bottom right):
    two layers' attention through one bound layout build its prefixes once and equal the masked-SDPA path."""
    built = []

    def counted(*args):
        built.append(args)
        return key_prefixes(*args)

    def reference_causal_gqa(q, k, v, cu_q, max_q, cu_k, max_k):
        out = torch.empty_like(q)
        for s in range(cu_q.shape[0] - 1):
            q0, q1, k0, k1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
            mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril(diagonal=(k1 - k0) - (q1 - q0))
            out[q0:q1] = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1),
                                                        v[k0:k1].transpose(0, 1), attn_mask=mask,
                                                        enable_gqa=True).transpose(0, 1)
        return out

    local = sharded(128, 4, 2, seed=1)
    layout = local["cp_layout"].to(torch.device("cpu"))
    q, k, v = attention_inputs(layout, 4, 2, 16, 16, torch.float32, monkeypatch)
    core = ContextParallelAttention()
    core.layout = layout
    masked = core(q, k, v, local["cu_seqlens"])

    monkeypatch.setattr(cp, "key_prefixes", counted)
    monkeypatch.setattr(cp, "causal_gqa", reference_causal_gqa)
    monkeypatch.setattr(cp, "_flash_runs", lambda *args: True)
    for _ in range(2):
        torch.testing.assert_close(core(q, k, v, local["cu_seqlens"]), masked)
    assert len(built) == 1


def test_a_layout_is_copied_to_a_device_once_and_builds_its_prefixes_from_the_host_doc_ids():
    host = sharded(64, 2, 0, seed=2)["cp_layout"]
    meta = torch.device("meta")  # a device without data: any read of its doc_ids would fail
    there = host.to(meta)
    assert host.to(meta) is there and there.doc_ids.device == meta and there.host_doc_ids is host.doc_ids
    pre, want = there.prefixes(), key_prefixes(host.doc_ids, 2, 0)
    assert pre.rows.device == meta and there.prefixes() is pre
    assert (pre.max_q, pre.max_k, pre.rows.shape, pre.cu_q.shape) == (want.max_q, want.max_k, want.rows.shape,
                                                                      want.cu_q.shape)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention runs on CUDA only")
def test_the_allgather_exchange_on_cuda_attends_through_the_layouts_prefixes_as_the_mask_does(monkeypatch):
    local = sharded(1024, 2, 1, seed=5)
    layout = local["cp_layout"].to(torch.device("cuda", torch.cuda.current_device()))
    q, k, v = attention_inputs(layout, 8, 2, 64, 64, torch.bfloat16, monkeypatch, "cuda")
    core = ContextParallelAttention()
    core.layout = layout
    out = core(q, k, v, local["cu_seqlens"].cuda())
    assert layout._prefixes is not None and layout._prefixes.rows.is_cuda  # the flash path ran

    mask = torch.cat([_visible(layout, 1, r) for r in range(2)], dim=1)
    k_all, v_all = (cp.gather_tokens(t, None).float().transpose(0, 1) for t in (k, v))
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1), k_all, v_all, attn_mask=mask,
                                         enable_gqa=True).transpose(0, 1)
    assert (out.float() - ref).abs().max() < 3e-2
