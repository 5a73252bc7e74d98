"""The ring exchange's work per hop as flash-attention blocks: which of a rank's queries attend which rows of the K/V
block resident at that hop, with no T x T mask.

Zigzag sharding puts chunks r and 2C-1-r of the packed micro-batch (2C chunks) on rank r. For query chunk i and key
chunk j the global mask (same document, not in the future) is:
- j > i: empty;
- j = i: causal inside each document: one causal varlen call over the rank's own tokens (segments break where the
  document changes and between its two chunks), at the hop where the rank's own K/V are resident;
- j < i: the keys of chunk j in a document that also has tokens in chunk i. Documents are contiguous runs of positions,
  so only one can: the document chunk i starts in, whose tokens end chunk j (if it reaches back that far) and start
  chunk i. That is one dense block, no mask at all: rows [0, n) of chunk i against the last m rows of chunk j.
Each block's output merges into the running one by log-sum-exp, as the fp32 ring does; backward runs flash backward on
every block against the final output and log-sum-exp, which makes each block's gradients its share of the whole.

`flash_block` / `flash_block_backward` are FlashAttention-2's varlen kernels (CUDA, 16-bit); `reference_block` and
`reference_block_backward` compute the same in fp32 torch with the same signatures (tests and the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.trainer.step import host_to_device


@dataclass
class Block:
    """Queries [q_lo, q_hi) of this rank against rows [k_lo, k_hi) of the resident K/V, as the varlen kernels take
    them: one dense segment, or (`causal`) the rank's own tokens with the segments `cu` over both."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    causal: bool = False
    cu: torch.Tensor | None = None  # int32 [segments + 1]; None: one segment, [0, n] against [0, m] (__post_init__)
    cu_k: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0

    def __post_init__(self):
        if self.cu is None:
            n, m = self.q_hi - self.q_lo, self.k_hi - self.k_lo
            self.cu, self.cu_k = torch.tensor([0, n], dtype=torch.int32), torch.tensor([0, m], dtype=torch.int32)
            self.max_q, self.max_k = n, m
        elif self.cu_k is None:
            self.cu_k = self.cu
            self.max_q = self.max_k = int((self.cu[1:] - self.cu[:-1]).max())

    def to(self, device: torch.device) -> "Block":
        """On `device` with the layout, once per micro-batch (pinned and non-blocking, as the layout's own copy)."""
        cu = host_to_device(self.cu, device)
        cu_k = cu if self.cu_k is self.cu else host_to_device(self.cu_k, device)
        return Block(self.q_lo, self.q_hi, self.k_lo, self.k_hi, self.causal, cu, cu_k, self.max_q, self.max_k)


def _dense(doc_ids: torch.Tensor, chunk: int, i: int, j: int, q_off: int, k_off: int) -> list[Block]:
    """Query chunk i (at local row q_off) against key chunk j < i (at row k_off of its rank): the one document both
    may hold (module docstring)."""
    queries = doc_ids[i * chunk:(i + 1) * chunk]
    keys = doc_ids[j * chunk:(j + 1) * chunk]
    doc = queries[0]
    n, m = int((queries == doc).sum()), int((keys == doc).sum())
    return [Block(q_off, q_off + n, k_off + chunk - m, k_off + chunk)] if m else []


def _own_segments(doc_ids: torch.Tensor, chunk: int, first: int, second: int) -> torch.Tensor:
    """int32 cu_seqlens of the rank's tokens (chunks `first` then `second`): a segment ends where the document changes
    and at the end of the first chunk, also where the two chunks are adjacent (there the dense block covers the
    second chunk's queries against the first chunk's keys)."""
    docs = torch.cat((doc_ids[first * chunk:(first + 1) * chunk], doc_ids[second * chunk:(second + 1) * chunk]))
    starts = torch.ones(2 * chunk, dtype=torch.bool)
    starts[1:] = docs[1:] != docs[:-1]
    starts[chunk] = True
    return torch.cat((starts.nonzero().flatten(), torch.tensor([2 * chunk]))).to(torch.int32)


def plan(doc_ids: torch.Tensor, size: int, rank: int) -> list[list[Block]]:
    """The blocks of every hop: plan[step] for the K/V of rank (rank - step) % size. `doc_ids` [T] on the host,
    ascending."""
    total = doc_ids.shape[0]
    chunk, last = total // (2 * size), 2 * size - 1
    hops = []
    for step in range(size):
        src = (rank - step) % size
        if src == rank:
            own = _own_segments(doc_ids, chunk, rank, last - rank)
            blocks = [Block(0, 2 * chunk, 0, 2 * chunk, True, own)]
            blocks += _dense(doc_ids, chunk, last - rank, rank, chunk, 0)
        else:
            blocks = _dense(doc_ids, chunk, rank, src, 0, 0) if src < rank else []
            blocks += _dense(doc_ids, chunk, last - rank, src, chunk, 0)
            if src > rank:
                blocks += _dense(doc_ids, chunk, last - rank, last - src, chunk, chunk)
        hops.append(blocks)
    return hops


# ---------------------------------------------------------------- one block: flash (CUDA) or fp32 torch


def flash_block(q, k, v, b: Block) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """q [n, H, d], k/v [m, Hkv, d] (16-bit, CUDA) -> (out [n, H, d], lse [H, n] fp32, the kernel's RNG state: what
    its backward takes back; without dropout it is never read)."""
    out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(q, k, v, b.cu, b.cu_k, b.max_q, b.max_k, 0.0,
                                                                        b.causal, False)
    return out, lse, (seed, offset)


def flash_block_backward(dout, q, k, v, out, lse, b: Block, rng: tuple) -> tuple[torch.Tensor, ...]:
    """The block's (dq, dk, dv) given the final `out` (q's dtype) and `lse` [H, n] of its queries."""
    dq, dk, dv = torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse, b.cu, b.cu_k, b.max_q, b.max_k,
                                                          0.0, b.causal, *rng)
    return dq, dk, dv


def _mask(b: Block, device: torch.device) -> torch.Tensor:
    n, m = b.q_hi - b.q_lo, b.k_hi - b.k_lo
    if not b.causal:
        return torch.ones(n, m, dtype=torch.bool, device=device)
    seg = torch.repeat_interleave(torch.arange(len(b.cu) - 1, device=device), (b.cu[1:] - b.cu[:-1]).long())
    pos = torch.arange(n, device=device)
    return (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    T, H, d = g.shape
    return g if H == kv_heads else g.view(T, kv_heads, H // kv_heads, d).sum(2)


def reference_block(q, k, v, b: Block) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """`flash_block` in fp32 torch (any device, any dtype in; out in q's dtype, as the kernel's)."""
    qf, kf, vf = q.float(), _expand(k.float(), q.shape[1]), _expand(v.float(), q.shape[1])
    s = torch.einsum("qhd,khd->hqk", qf, kf) * q.shape[-1] ** -0.5
    s = s.masked_fill(~_mask(b, q.device)[None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), vf).to(q.dtype), lse, ()


def reference_block_backward(dout, q, k, v, out, lse, b: Block, rng: tuple = ()) -> tuple[torch.Tensor, ...]:
    """`flash_block_backward` in fp32 torch."""
    H, kv_heads, scale = q.shape[1], k.shape[1], q.shape[-1] ** -0.5
    qf, kf, vf, do = q.float(), _expand(k.float(), H), _expand(v.float(), H), dout.float()
    s = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    p = torch.exp(s.masked_fill(~_mask(b, q.device)[None], float("-inf")) - lse[..., None])
    delta = (do * out.float()).sum(-1).transpose(0, 1)
    ds = p * (torch.einsum("qhd,khd->hqk", do, vf) - delta[..., None]) * scale
    dq = torch.einsum("hqk,khd->qhd", ds, kf)
    dk, dv = torch.einsum("hqk,qhd->khd", ds, qf), torch.einsum("hqk,qhd->khd", p, do)
    return dq.to(q.dtype), _fold(dk, kv_heads).to(k.dtype), _fold(dv, kv_heads).to(v.dtype)
