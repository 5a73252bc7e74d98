"""Queries that continue a cached prefix (`packed_causal_attention` with `cu_seqlens_k`, the rollout's chunked and
prefix-shared prefill): segment i's n queries against its m keys are the last n of the m positions, so each query's
output is the one the full causal attention over the m tokens gives it; on CPU (masked SDPA) and on CUDA (FlashAttention
over key segments), GQA heads and MLA's narrower values alike."""

from __future__ import annotations

import pytest
import torch

from services.trainer.model.attention import packed_causal_attention

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("heads_q,heads_kv,d,dv", [(8, 2, 64, 64), (4, 4, 48, 32), (6, 1, 32, 32)])
@pytest.mark.parametrize("device", DEVICES)
def test_each_query_sees_its_segments_prefix_and_the_queries_before_it(device, heads_q, heads_kv, d, dv):
    gen = torch.Generator().manual_seed(0)
    keys = [40, 7, 100, 1, 64]  # m per segment
    queries = [3, 7, 100, 1, 20]  # n <= m: the last n positions (7 and 100: the whole segment, no prefix)
    k = torch.randn(sum(keys), heads_kv, d, generator=gen)
    v = torch.randn(sum(keys), heads_kv, dv, generator=gen)
    q_full = torch.randn(sum(keys), heads_q, d, generator=gen)  # a query for every position; the last n are fed
    cu_k = _cu(keys)
    rows = torch.cat([torch.arange(int(e) - n, int(e)) for e, n in zip(cu_k[1:], queries)])
    expected = packed_causal_attention(q_full, k, v, cu_k)[rows]  # the full causal attention's rows of those queries

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (t.to(device, dtype) for t in (q_full[rows], k, v))
    got = packed_causal_attention(q, k, v, _cu(queries).to(device), max(queries), cu_k.to(device), max(keys))
    assert got.shape == (len(rows), heads_q, dv)
    tol = 2e-2 if device == "cuda" else 1e-5  # bf16 inputs against fp32 math on CUDA
    torch.testing.assert_close(got.float().cpu(), expected, rtol=tol, atol=tol)
