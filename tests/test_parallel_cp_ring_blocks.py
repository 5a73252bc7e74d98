"""Context parallelism's ring exchange on CUDA runs flash attention over mask-free blocks (ring_blocks.py).

Specification:
- for CP groups of 2, 3 and 4, every rank and every hop, the blocks `ring_blocks.plan` lays out (one causal varlen
  block over the rank's own tokens, dense blocks otherwise) let a query see exactly the keys `_visible` allows, each
  key at most once: packed micro-batches of many documents, some spanning several chunks, and one document over all;
- the ring over those blocks (`_BlockRingAttention`), run on gloo ranks with the fp32 block reference standing in for
  the flash kernels, equals single-process attention over the whole micro-batch, output and the gradients of q, k and
  v, within 1e-5 (fp32; grouped K/V heads), for CP 2 and 3;
- on a GPU, the flash kernels on every block of every hop equal the fp32 reference, forward (out, lse) and backward,
  within bf16 rounding.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from parallel_harness import spawn_ranks
from services.trainer.model.attention import document_ids
from services.trainer.parallel import ring_blocks
from services.trainer.parallel.context_parallel import CPLayout, _BlockRingAttention, _visible, zigzag_index


def packed_doc_ids(total: int, seed: int) -> torch.Tensor:
    if seed < 0:
        return torch.zeros(total, dtype=torch.int64)  # one document over every chunk
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(total - 1, generator=g)[:int(torch.randint(1, 10, (), generator=g))] + 1
    cu = torch.cat((torch.tensor([0]), cuts.sort().values, torch.tensor([total])))
    return document_ids(cu, total)


def plan_of(doc_ids: torch.Tensor, size: int, rank: int) -> list[list[ring_blocks.Block]]:
    return ring_blocks.plan(doc_ids, size, rank)


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("seed", [-1, *range(5)])
def test_the_blocks_of_every_hop_show_each_query_exactly_the_keys_the_mask_allows(size, seed):
    doc_ids = packed_doc_ids(24 * size, seed)
    for rank in range(size):
        layout = CPLayout(None, rank, size, doc_ids)
        for step, blocks in enumerate(plan_of(doc_ids, size, rank)):
            src = (rank - step) % size
            want = _visible(layout, rank, src)
            seen = torch.zeros(want.shape, dtype=torch.int64)
            for b in blocks:
                seen[b.q_lo:b.q_hi, b.k_lo:b.k_hi] += ring_blocks._mask(b, torch.device("cpu")).long()
            assert seen.max() <= 1, (size, seed, rank, step)
            assert torch.equal(seen.bool(), want), (size, seed, rank, step)


def _reference_attention(q, k, v, doc_ids):
    """Single-process attention over the whole micro-batch, fp32, under the document-causal mask."""
    T, H = q.shape[:2]
    k, v = (t.repeat_interleave(H // t.shape[1], dim=1) for t in (k, v))
    mask = (doc_ids[:, None] == doc_ids[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    s = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    return torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v)


def _inputs(total: int, heads: int, kv_heads: int, d: int):
    g = torch.Generator().manual_seed(11)
    return [torch.randn(total, h, d, generator=g, dtype=torch.float64).float() for h in (heads, kv_heads, kv_heads)]


def _ring_worker(rank: int, world: int, out_dir: str, seed: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        total = 16 * world
        doc_ids = packed_doc_ids(total, seed)
        index = zigzag_index(total, world, rank)
        q, k, v = (t[index].clone().requires_grad_() for t in _inputs(total, 4, 2, 8))
        layout = CPLayout(dist.group.WORLD, rank, world, doc_ids)
        out = _BlockRingAttention.apply(q, k, v, layout, (ring_blocks.reference_block,
                                                          ring_blocks.reference_block_backward))
        g = torch.Generator().manual_seed(5)
        dout = torch.randn(total, 4, 8, generator=g)[index]
        out.backward(dout)
        torch.save({"index": index, "out": out.detach(), "grads": [t.grad for t in (q, k, v)]},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, seed", [(2, 0), (2, -1), (3, 3)])
def test_the_ring_over_blocks_equals_whole_attention_forward_and_backward(world, seed, tmp_path):
    results = spawn_ranks(_ring_worker, (world, str(tmp_path), seed), world, str(tmp_path), timeout_s=120)
    total = 16 * world
    q, k, v = (t.requires_grad_() for t in _inputs(total, 4, 2, 8))
    out = _reference_attention(q, k, v, packed_doc_ids(total, seed))
    out.backward(torch.randn(total, 4, 8, generator=torch.Generator().manual_seed(5)))
    for rank, r in enumerate(results):
        i = r["index"]
        torch.testing.assert_close(r["out"], out.detach()[i], rtol=0, atol=1e-5, msg=f"rank {rank}: out")
        for name, got, want in zip("qkv", r["grads"], (q.grad, k.grad, v.grad)):
            torch.testing.assert_close(got, want[i], rtol=0, atol=1e-5, msg=f"rank {rank}: d{name}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention runs on CUDA only")
@pytest.mark.parametrize("size", [2, 4])
def test_flash_blocks_equal_the_fp32_reference_on_cuda(size):
    cuda = torch.device("cuda")
    total, heads, kv_heads, d = 256 * size, 8, 2, 64
    doc_ids = packed_doc_ids(total, 2)
    g = torch.Generator(device=cuda).manual_seed(0)
    for rank in range(size):
        for blocks in plan_of(doc_ids, size, rank):
            for b in (b.to(cuda) for b in blocks):
                n, m = b.q_hi - b.q_lo, b.k_hi - b.k_lo
                q = torch.randn(n, heads, d, device=cuda, generator=g).bfloat16()
                k, v = (torch.randn(m, kv_heads, d, device=cuda, generator=g).bfloat16() for _ in range(2))
                out, lse, rng = ring_blocks.flash_block(q, k, v, b)
                ref_out, ref_lse, _ = ring_blocks.reference_block(q, k, v, b)
                assert lse.shape == (heads, n)
                torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)
                torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)
                dout = torch.randn(n, heads, d, device=cuda, generator=g).bfloat16()
                got = ring_blocks.flash_block_backward(dout, q, k, v, out, lse, b, rng)
                want = ring_blocks.reference_block_backward(dout, q, k, v, out, lse, b)
                for a, w in zip(got, want):
                    torch.testing.assert_close(a.float(), w.float(), rtol=3e-2, atol=3e-2)
