"""Context parallelism: a micro-batch's tokens are split over a CP group, attention exchanges keys/values.

Sharding is zigzag: the packed micro-batch of T tokens is cut into 2·CP equal chunks and rank r keeps chunks r and
2·CP-1-r, so every rank holds one early and one late chunk and causal attention work is even. Documents are not aligned
to chunks; a document that spans chunks keeps its identity: a query sees every key of its own document at an earlier or
equal global position, wherever that key lives. The layout (global position and document of every token) is carried
by `CPLayout`; position_ids stay the in-document positions, so RoPE is unchanged.

KV exchange, chosen by `parallel.cp_comm`:
- ring: K/V blocks travel around the group; each step computes the resident block while the next one is in flight
  (batched isend/irecv) and merges partial results by log-sum-exp. Backward travels the ring again with the K/V gradient
  accumulating alongside its block, and a last hop brings each block's gradient home. On CUDA each hop is a few flash
  attention calls over blocks the zigzag layout makes mask-free (ring_blocks.py); elsewhere fp32 math under the mask.
- allgather: K/V are all-gathered once (backward reduce-scatters their gradients) and attention runs against all keys;
  on CUDA as flash attention over segments: each document's queries in a chunk against the document's keys up to the
  chunk's end (`key_prefixes`), with no T x T mask.
Values may be narrower than queries and keys (MLA's v_head_dim): a ring message is K and V side by side on the last dim.

The CP group (hence size) can change per micro-batch (dynamic CP): the group travels with the layout, and `cp_share`
picks which of its dp rank's micro-batches each CP block runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from services.dataloader.cp_sizing import attention_cost, block_share, segment_lengths
from services.trainer.model.attention import PackedAttention, document_ids, packed_causal_attention
from services.trainer.model.flash_varlen import causal_gqa
from services.trainer.model.moe.router import Router
from services.trainer.model.recompute import same_as_forward
from services.trainer.model.mtp import future_labels
from services.trainer.parallel import ring_blocks
from services.trainer.parallel.differentiable import gather_tokens
from services.trainer.parallel.groups import ParallelGroups
from services.trainer.step import host_to_device

ProcessGroup = dist.ProcessGroup
CPComm = Literal["ring", "allgather"]


# ---------------------------------------------------------------- layout and sharding


def zigzag_index(total: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global token indices held by `cp_rank`: chunks cp_rank and 2·cp_size-1-cp_rank of 2·cp_size."""
    if total % (2 * cp_size):
        raise ValueError(f"a micro-batch of {total} tokens cannot be cut into 2*cp = {2 * cp_size} equal chunks; "
                         f"make data.micro_batch_size * data.seq_len a multiple of {2 * cp_size} (times tp with "
                         f"sequence parallelism)")
    chunk = total // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, device=device)
    return torch.cat((first, last))


@dataclass
class KeyPrefixes:
    """A rank's queries of an all-gathered micro-batch as flash-attention segments (`key_prefixes`)."""

    rows: torch.Tensor  # [sum of prefix lengths] int64: each segment's keys, as rows of the all-gathered K/V
    cu_q: torch.Tensor  # [segments + 1] int32: the segments, over the rank's tokens in their local order
    cu_k: torch.Tensor  # [segments + 1] int32: their key prefixes, over `rows`
    max_q: int
    max_k: int

    def to(self, device: torch.device) -> "KeyPrefixes":
        return KeyPrefixes(host_to_device(self.rows, device), host_to_device(self.cu_q, device),
                           host_to_device(self.cu_k, device), self.max_q, self.max_k)


def key_prefixes(doc_ids: torch.Tensor, size: int, rank: int) -> KeyPrefixes:
    """Each run of one document's tokens inside one of `rank`'s zigzag chunks is a query segment; its keys are that
    document's tokens from the document's start to the segment's end. Aligned at the bottom right (the queries are the
    prefix's last tokens), causal attention over each (segment, prefix) pair is exactly the global mask `_visible`
    draws: same document, not in the future. `doc_ids` [T] ascends (packed documents); computed on the host."""
    total = doc_ids.shape[0]
    index = zigzag_index(total, size, rank)  # local token -> global position
    gathered = torch.cat([zigzag_index(total, size, r) for r in range(size)])  # all-gathered row -> global position
    row_of = torch.empty_like(gathered)
    row_of[gathered] = torch.arange(total)
    docs = doc_ids.cpu()[index]
    starts_segment = torch.ones(index.shape[0], dtype=torch.bool)
    starts_segment[1:] = (docs[1:] != docs[:-1]) | (index[1:] != index[:-1] + 1)
    starts = starts_segment.nonzero().flatten()
    ends = torch.cat((starts[1:], torch.tensor([index.shape[0]])))
    q_len = ends - starts
    first = torch.searchsorted(doc_ids.cpu(), docs[starts])  # the global position each segment's document starts at
    k_len = index[ends - 1] + 1 - first
    at = torch.cumsum(k_len, 0) - k_len  # where each prefix starts in `rows`
    positions = torch.arange(int(k_len.sum())) - torch.repeat_interleave(at - first, k_len)
    zero = torch.zeros(1, dtype=torch.int64)
    return KeyPrefixes(row_of[positions], torch.cat((zero, torch.cumsum(q_len, 0))).int(),
                       torch.cat((zero, torch.cumsum(k_len, 0))).int(), int(q_len.max()), int(k_len.max()))


@dataclass
class CPLayout:
    """Where a CP-sharded micro-batch's tokens came from; enough for any rank to mask any other rank's keys."""

    group: ProcessGroup
    rank: int
    size: int
    doc_ids: torch.Tensor  # [T] int64: document (segment) of every token of the whole micro-batch
    comm: CPComm = "ring"
    host_doc_ids: torch.Tensor | None = None  # doc_ids on the host when doc_ids is not (`key_prefixes` runs there)
    _prefixes: KeyPrefixes | None = field(default=None, init=False, repr=False)
    _ring_blocks: list[list[ring_blocks.Block]] | None = field(default=None, init=False, repr=False)
    _copies: dict = field(default_factory=dict, init=False, repr=False)  # device -> this layout there

    @property
    def total(self) -> int:
        return self.doc_ids.shape[0]

    def index(self, rank: int) -> torch.Tensor:
        return zigzag_index(self.total, self.size, rank, self.doc_ids.device)

    @property
    def _host_doc_ids(self) -> torch.Tensor:
        return self.doc_ids if self.host_doc_ids is None else self.host_doc_ids

    def prefixes(self) -> KeyPrefixes:
        """The all-gather exchange's flash segments (`key_prefixes`) on doc_ids' device. Computed on first use, from
        the host's doc_ids (no device-to-host wait): only the flash path (`_flash_runs`) reads them, and the
        layers of a micro-batch share its bound layout, so they are computed once per micro-batch where they are."""
        if self._prefixes is None:
            self._prefixes = key_prefixes(self._host_doc_ids, self.size, self.rank).to(self.doc_ids.device)
        return self._prefixes

    def ring_blocks(self) -> list[list[ring_blocks.Block]]:
        """The ring exchange's flash blocks per hop (ring_blocks.plan), as `prefixes`: computed on first use from the
        host's doc_ids, once per micro-batch, read only where `_flash_runs`."""
        if self._ring_blocks is None:
            self._ring_blocks = [[b.to(self.doc_ids.device) for b in hop]
                                 for hop in ring_blocks.plan(self._host_doc_ids, self.size, self.rank)]
        return self._ring_blocks

    def to(self, device: torch.device) -> "CPLayout":
        """This layout on `device`, copied once (`bind_micro_batch` runs at every chunk and pair switch of a
        micro-batch) without waiting for the device (`host_to_device`: pinned buffer, non-blocking)."""
        if self.doc_ids.device == device:
            return self
        if device not in self._copies:
            host = self.doc_ids if self.doc_ids.device.type == "cpu" else self.host_doc_ids
            self._copies[device] = CPLayout(self.group, self.rank, self.size, host_to_device(self.doc_ids, device),
                                            self.comm, host)
        return self._copies[device]


def local_cu_seqlens(doc_ids: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Segment boundaries over the local tokens: a new segment wherever the document changes or the chunks jump."""
    doc, n = doc_ids[index], index.shape[0]
    starts = torch.ones(n, dtype=torch.bool, device=index.device)
    starts[1:] = (doc[1:] != doc[:-1]) | (index[1:] != index[:-1] + 1)
    bounds = torch.nonzero(starts).flatten()
    return torch.cat((bounds, torch.tensor([n], device=index.device))).to(torch.int32)


def cp_share(micro_batches: list[dict], cp: int, cp_rank: int) -> list[dict]:
    """The micro-batches CP rank `cp_rank` runs, out of its dp rank's step (every CP peer receives all of them), in the
    order it runs them: `cp_sizing.block_share`'s plan. A micro-batch it moves onto the whole CP group (left over after
    equal block shares) comes with its `cp_size` set to `cp`."""
    sizes = [int(mb.get("cp_size", cp)) for mb in micro_batches]
    costs = [attention_cost(segment_lengths(mb["cu_seqlens"])) if c < cp else 0 for mb, c in zip(micro_batches, sizes)]
    return [micro_batches[i] if c == sizes[i] else {**micro_batches[i], "cp_size": torch.tensor(c)}
            for i, c in block_share(sizes, costs, cp, cp_rank)]


def shard_micro_batch(mb: dict, groups: ParallelGroups, comm: CPComm = "ring", mtp_depths: int = 0) -> dict:
    """This rank's zigzag share of a packed micro-batch, over the CP group of the size the micro-batch was sized for.

    `mb["cp_size"]` (set by the dataloader's dynamic CP sizing; default `parallel.cp`) picks the pre-built group; size
    1 returns the micro-batch unchanged. The result holds local tokens/labels/position_ids, local cu_seqlens
    (segments of the local tokens, for per-document statistics) and `cp_layout` for the attention cores; with
    `mtp_depths` (model.mtp_num_layers), also `mtp_labels` [depths, local tokens]: the labels shifted inside each
    document before the cut, since a chunk's following tokens sit on another rank (mtp.py).
    """
    axis = groups.cp_of(int(mb["cp_size"])) if "cp_size" in mb else groups.cp
    if axis.size == 1:
        return mb
    total = mb["tokens"].shape[0]
    doc_ids = document_ids(mb["cu_seqlens"], total)
    index = zigzag_index(total, axis.size, axis.rank, doc_ids.device)
    local = {k: v for k, v in mb.items() if k not in ("tokens", "labels", "position_ids", "cu_seqlens", "max_seqlen")}
    local.update(tokens=mb["tokens"][index], labels=mb["labels"][index], position_ids=mb["position_ids"][index],
                 cu_seqlens=local_cu_seqlens(doc_ids, index),
                 cp_layout=CPLayout(axis.group, axis.rank, axis.size, doc_ids, comm))
    if mtp_depths:
        local["mtp_labels"] = future_labels(mb["labels"], doc_ids, mtp_depths)[:, index]
    return local


# ---------------------------------------------------------------- attention blocks (fp32 math, explicit LSE)


def _visible(layout: CPLayout, q_rank: int, k_rank: int) -> torch.Tensor:
    """[Tq, Tk] bool: key j is visible to query i (same document, not in the future)."""
    qi, ki = layout.index(q_rank), layout.index(k_rank)
    return (layout.doc_ids[qi][:, None] == layout.doc_ids[ki][None, :]) & (ki[None, :] <= qi[:, None])


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold_kv_grad(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum the gradients of query heads that shared a key/value head (inverse of `_expand_kv`)."""
    T, H, d = g.shape
    return g if H == kv_heads else g.view(T, kv_heads, H // kv_heads, d).sum(2)


def _block_scores(q, k, mask):
    """q: [Tq, H, d] fp32, k: [Tk, H, d] fp32 -> masked scores [H, Tq, Tk]."""
    s = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    return s.masked_fill(~mask[None], float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def block_attention(q, k, v, mask):
    """One query block against one key block: (out [Tq, H, d], lse [H, Tq]); rows with no visible key: 0 and -inf."""
    s = _block_scores(q, k, mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse)[..., None])
    return torch.einsum("hqk,khd->qhd", p, v), lse


def merge(out, lse, block_out, block_lse):
    """Online-softmax merge of two partial attentions over disjoint key sets."""
    if out is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)
    a, b = torch.exp(lse - _finite(new)), torch.exp(block_lse - _finite(new))
    return out * a.transpose(0, 1)[..., None] + block_out * b.transpose(0, 1)[..., None], new


def block_attention_backward(q, k, v, mask, out, lse, dout, delta):
    """Gradients of one block given the *final* out/lse (flash-attention recurrence): (dq, dk, dv), all fp32."""
    s = _block_scores(q, k, mask)
    p = torch.exp(s - _finite(lse)[..., None])  # exactly this block's share of the final softmax
    dv = torch.einsum("hqk,qhd->khd", p, dout)
    dp = torch.einsum("qhd,khd->hqk", dout, v)
    ds = p * (dp - delta[..., None]) * q.shape[-1] ** -0.5
    return torch.einsum("hqk,khd->qhd", ds, k), torch.einsum("hqk,qhd->khd", ds, q), dv


# ---------------------------------------------------------------- ring exchange


def _ring_shift(send: torch.Tensor, layout: CPLayout) -> tuple[torch.Tensor, list]:
    """Start sending `send` to the next rank and receiving the previous rank's tensor of the same shape."""
    recv = torch.empty_like(send)
    nxt, prev = (layout.rank + 1) % layout.size, (layout.rank - 1) % layout.size
    ops = [dist.P2POp(dist.isend, send, group=layout.group, group_peer=nxt),
           dist.P2POp(dist.irecv, recv, group=layout.group, group_peer=prev)]
    return recv, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _split_kv(kv: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a ring message: [T, Hkv, d + dv], the value head dim dv possibly another than d (MLA)."""
    return kv[..., :d], kv[..., d:]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: CPLayout):
        H, kv_heads, d = q.shape[1], k.shape[1], k.shape[-1]
        qf = q.float()
        kv = torch.cat((k, v), dim=-1)  # one message per hop
        out = lse = None
        for step in range(layout.size):
            pending = None
            if step < layout.size - 1:
                nxt_kv, pending = _ring_shift(kv, layout)
            src = (layout.rank - step) % layout.size
            mask = _visible(layout, layout.rank, src)
            if mask.any():  # zigzag makes some blocks entirely future: skip them
                kb, vb = (_expand_kv(t.float(), H) for t in _split_kv(kv, d))
                out, lse = merge(out, lse, *block_attention(qf, kb, vb, mask))
            if pending is not None:
                _wait(pending)
                kv = nxt_kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.kv_heads = layout, kv_heads
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        layout, H, d = ctx.layout, q.shape[1], k.shape[-1]
        qf, dout = q.float(), dout.float()
        delta = (dout * out).sum(-1).transpose(0, 1)  # [H, Tq]: rowsum(dO ∘ O)
        dq = torch.zeros_like(qf)
        kv = torch.cat((k, v), dim=-1)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for step in range(layout.size):
            pending = None
            if step < layout.size - 1:
                nxt_kv, pending = _ring_shift(kv, layout)  # K/V move on while this block's gradients are computed
            src = (layout.rank - step) % layout.size
            mask = _visible(layout, layout.rank, src)
            if mask.any():
                kb, vb = (_expand_kv(t.float(), H) for t in _split_kv(kv, d))
                dqb, dkb, dvb = block_attention_backward(qf, kb, vb, mask, out, lse, dout, delta)
                dq += dqb
                dk, dv = _split_kv(dkv, d)
                dk += _fold_kv_grad(dkb, ctx.kv_heads)
                dv += _fold_kv_grad(dvb, ctx.kv_heads)
            # The K/V gradient follows its block; after the last step it is one hop from home, and takes that hop.
            dkv, dkv_pending = _ring_shift(dkv, layout)
            _wait(dkv_pending)
            if pending is not None:
                _wait(pending)
                kv = nxt_kv
        dk, dv = _split_kv(dkv, d)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


class _BlockRingAttention(torch.autograd.Function):
    """The ring over flash blocks (ring_blocks.py): K and V travel in the activations' dtype, as one [2, T, Hkv, d]
    message per hop; each hop's blocks merge into an fp32 output by log-sum-exp. `ops`: (block, block_backward) of
    ring_blocks, flash on CUDA, the fp32 reference in tests."""

    @staticmethod
    def forward(ctx, q, k, v, layout: CPLayout, ops):
        block, _ = ops
        hops, (T, H) = layout.ring_blocks(), q.shape[:2]
        out = torch.zeros(T, H, v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full((H, T), float("-inf"), dtype=torch.float32, device=q.device)
        kv = home = torch.stack((k, v))
        rng = ()
        for step in range(layout.size):
            pending = None
            if step < layout.size - 1:
                nxt_kv, pending = _ring_shift(kv, layout)
            for b in hops[step]:
                rows = slice(b.q_lo, b.q_hi)
                block_out, block_lse, rng = block(q[rows], kv[0, b.k_lo:b.k_hi], kv[1, b.k_lo:b.k_hi], b)
                out[rows], lse[:, rows] = merge(out[rows], lse[:, rows], block_out.float(), block_lse)
            if pending is not None:
                _wait(pending)
                kv = nxt_kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, home, out, lse)
        ctx.layout, ctx.ops, ctx.rng = layout, ops, rng
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        layout, (_, block_backward), hops = ctx.layout, ctx.ops, ctx.layout.ring_blocks()
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for step in range(layout.size):
            pending = None
            if step < layout.size - 1:
                nxt_kv, pending = _ring_shift(kv, layout)
            for b in hops[step]:
                rows, keys = slice(b.q_lo, b.q_hi), slice(b.k_lo, b.k_hi)
                dqb, dkb, dvb = block_backward(dout[rows], q[rows], kv[0, keys], kv[1, keys], out[rows],
                                               lse[:, rows].contiguous(), b, ctx.rng)
                dq[rows] += dqb
                dkv[0, keys] += dkb
                dkv[1, keys] += dvb
            dkv, dkv_pending = _ring_shift(dkv, layout)  # the gradient follows its block, and last takes it home
            _wait(dkv_pending)
            if pending is not None:
                _wait(pending)
                kv = nxt_kv
        return dq.to(q.dtype), dkv[0].to(q.dtype), dkv[1].to(q.dtype), None, None


FLASH_BLOCKS = (ring_blocks.flash_block, ring_blocks.flash_block_backward)


# ---------------------------------------------------------------- all-gather exchange


def _flash_runs(device: torch.device, dtype: torch.dtype, head_dim: int, v_head_dim: int) -> bool:
    """Whether either exchange runs flash attention (over key prefixes, or the ring's blocks): on CUDA, in 16 bits,
    with values as wide as keys (MLA's narrower values take SDPA or the fp32 ring). The one place that decides, so the
    only gate of `CPLayout.prefixes` and `CPLayout.ring_blocks`."""
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and v_head_dim == head_dim


def _allgather_attention(q, k, v, layout: CPLayout) -> torch.Tensor:
    """All-gathered K/V (rank order), then attention of the local queries against every key: flash attention over the
    layout's key prefixes where `_flash_runs`, elsewhere SDPA under the visibility mask."""
    k_all, v_all = gather_tokens(k, layout.group), gather_tokens(v, layout.group)
    if _flash_runs(q.device, q.dtype, q.shape[-1], v.shape[-1]):
        pre = layout.prefixes()
        return causal_gqa(q, k_all[pre.rows], v_all[pre.rows], pre.cu_q, pre.max_q, pre.cu_k, pre.max_k)
    mask = torch.cat([_visible(layout, layout.rank, r) for r in range(layout.size)], dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k_all.transpose(0, 1), v_all.transpose(0, 1),
                                         attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(0, 1)


# ---------------------------------------------------------------- the swapped-in core


def attend(q, k, v, cu_seqlens, max_seqlen, layout: CPLayout | None) -> torch.Tensor:
    """Attention of this rank's queries over the micro-batch cut by `layout` (None or size 1: not cut, local attention).
    Reads nothing but its arguments, so a recompute in backward repeats exactly the forward it stands for."""
    if layout is None or layout.size == 1:
        return packed_causal_attention(q, k, v, cu_seqlens, max_seqlen)
    if layout.total != layout.size * q.shape[0]:
        raise RuntimeError(f"attention got {q.shape[0]} tokens but the bound CP layout gives this rank "
                           f"{layout.total // layout.size}; call bind_micro_batch with the micro-batch being run")
    if layout.comm == "allgather":
        return _allgather_attention(q, k, v, layout)
    if _flash_runs(q.device, q.dtype, q.shape[-1], v.shape[-1]):
        return _BlockRingAttention.apply(q, k, v, layout, FLASH_BLOCKS)
    return _RingAttention.apply(q, k, v, layout)


class ContextParallelAttention(nn.Module):
    """Attention core with `packed_causal_attention`'s signature; the micro-batch's layout is bound before forward.

    The layout is per micro-batch state (like the router's replay ids) because the model's forward signature is the
    single-device one; `bind_micro_batch` sets it, and the ring's autograd Function keeps its own copy for backward, so
    several micro-batches may be in flight (pipeline schedules). A recompute in backward must see the layout of the
    forward it repeats, not the one bound by then (another micro-batch's, under pairs or 1F1B): forward reads the
    layout through `same_as_forward`, so when it runs again under a checkpoint (`model.recompute: [attn_core]` wraps it,
    as does a recomputed block, "layer"), it takes the layout its first run read.
    """

    def __init__(self):
        super().__init__()
        self.layout: CPLayout | None = None

    def forward(self, q, k, v, cu_seqlens, max_seqlen=None):
        return attend(q, k, v, cu_seqlens, max_seqlen, same_as_forward((self, "layout"), lambda: self.layout))


@dataclass(frozen=True)
class CPModules:
    """What a micro-batch's layout is bound to (`bind_layout`): the model's context-parallel attention cores, and its
    routers, whose aux and z-loss statistics span the micro-batch's CP group.

    Listed once, by `apply_context_parallel`, and kept on the model (`model.cp_modules`): binding runs before every
    micro-batch forward and at every switch of an interleaved pair, where walking a 48-layer model's ~700 modules took
    about a millisecond of host time (bench/bench_bind_layout.py). `parallelize` swaps the cores in last, on the
    pipeline stage, so the list holds exactly the modules the stage runs; `copy.deepcopy` (RL's reference policy)
    gives a copy the list of its own modules."""

    cores: tuple[ContextParallelAttention, ...]
    routers: tuple[Router, ...]


def apply_context_parallel(model: nn.Module) -> nn.Module:
    """Swap every attention core for the context-parallel one, in place (groups come per micro-batch, in the layout),
    and list what binding a layout sets on the model (`CPModules`)."""
    for module in model.modules():
        if isinstance(module, PackedAttention):
            if hasattr(module.core, "__wrapped__"):  # recompute.checkpointed: swapping the core would drop it
                raise RuntimeError("apply_context_parallel after the memory policy: the attention cores are already "
                                   "wrapped (model.recompute 'attn_core'); parallelize first, then apply the policy")
            module.core = ContextParallelAttention()
    model.cp_modules = CPModules(tuple(m for m in model.modules() if isinstance(m, ContextParallelAttention)),
                                 tuple(m for m in model.modules() if isinstance(m, Router)))
    return model


def is_context_parallel(model: nn.Module) -> bool:
    """Whether `model`'s attention cores are the context-parallel ones (`apply_context_parallel`)."""
    return getattr(model, "cp_modules", None) is not None


def bind_micro_batch(model: nn.Module, mb: dict) -> None:
    """Point every context-parallel core (and router) at this micro-batch's layout (None: unsharded, local attention)."""
    bind_layout(model, mb.get("cp_layout"), mb["tokens"].device)


def bind_layout(model: nn.Module, layout: CPLayout | None, device: torch.device) -> None:
    """Point every context-parallel core (and router) at `layout`, copied to `device` (None: local attention). On a
    model without context parallelism there is nothing to bind: its attention is local and its routers' `cp_group`
    stays None."""
    modules: CPModules | None = getattr(model, "cp_modules", None)
    if modules is None:
        if layout is not None and layout.size > 1:
            raise RuntimeError(f"a micro-batch cut over {layout.size} CP ranks was bound to a model without "
                               "context-parallel attention cores; parallelize the model (apply_context_parallel) "
                               "with the parallel.cp / parallel.cp_sizes the micro-batches were cut for")
        return
    group = layout.group if layout is not None and layout.size > 1 else None
    if layout is not None:
        layout = layout.to(device)
    for core in modules.cores:
        core.layout = layout
    for router in modules.routers:  # aux/z-loss statistics over the whole micro-batch
        if router.cp_group is not group:  # static CP: set once (a module's setattr costs microseconds of host time)
            router.cp_group = group
