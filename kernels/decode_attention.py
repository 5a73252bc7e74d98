"""One query token per sequence attending to its sequence's cached keys and values, read in place by slot: the
rollout's decode attention.

    decode_attention(q [B, H, d], k_cache [S, Hkv, L, d], v_cache [S, Hkv, L, dv], slot [B] int64, pos [B] int64,
                     span: int) -> [B, H, dv]

Row b attends, with softmax scale 1 / sqrt(d), to positions 0 .. pos[b] (the token just written included) of cache
slot slot[b]; query head h reads key/value head h // (H / Hkv) (grouped-query attention). `span` > every pos: how many
positions the reference gathers (the decode step's bucket); the kernel reads each row's pos[b] + 1.

Why a kernel: in torch ops the batch's caches are first gathered by slot (`k_cache[slot, :, :span]`, a copy of
B x Hkv x span x d keys and as many values, each layer and step), then attended by SDPA under a mask. Here a program
per (row, key/value head) reads that slot's keys and values in place, once, for all the query heads sharing them
(online softmax over blocks of positions, both products on the tensor cores), and stops at the row's own length.
Where rows are few and long (a long generation's last sequences: a program per row and head would leave most of the
GPU idle), each row's positions are also split over programs (`split_positions`, flash-decoding) whose unnormalised
results, maxima and sums `combine_splits` merges.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._triton import use_triton

BLOCK_N = 32  # cached positions a program reads per iteration
# Rows few and long: each row's positions split over programs (`split_positions`) towards this many programs in all,
# no split shorter than SPLIT_MIN positions
PROGRAMS = 512
SPLIT_MIN = 256


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor
           ) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"decode_attention wants q [B, H, d] and caches [S, Hkv, L, d], got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if q.shape[1] % k_cache.shape[1] or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"decode_attention: {q.shape[1]} query heads of dim {q.shape[2]} cannot read "
                         f"{k_cache.shape[1]} key heads of dim {k_cache.shape[3]}")
    if slot.shape != (q.shape[0],) or pos.shape != (q.shape[0],):
        raise ValueError(f"decode_attention wants slot and pos of shape [{q.shape[0]}], got {tuple(slot.shape)} and "
                         f"{tuple(pos.shape)}")


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: torch.Tensor,
                               pos: torch.Tensor, span: int) -> torch.Tensor:
    """Same contract as `decode_attention`, in torch ops: the slots' first `span` positions gathered, then SDPA."""
    _check(q, k_cache, v_cache, slot, pos)
    keys, values = k_cache[slot, :, :span], v_cache[slot, :, :span]  # [B, Hkv, span, d]
    visible = torch.arange(span, device=q.device)[None, :] <= pos[:, None]
    return F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=visible[:, None, None, :],
                                          enable_gqa=keys.shape[1] != q.shape[1])[:, :, 0]


@triton.jit
def online_softmax_step(s, visible, scale, m, total):
    """Scores s [rows, block] of one block of positions (`visible` [block]) into a running softmax per row: ->
    (p, the block's unnormalised probabilities; alpha, the rescale of what came before; the new max; the new sum).
    The new max is finite where the block's first position is visible."""
    s = tl.where(visible[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m - m_new)
    return p, alpha, m_new, total * alpha + tl.sum(p, axis=1)


@triton.jit
def store_split(part_ptr, ml_ptr, at, half, acc, m, total, rows_ok, cols, COLS: tl.constexpr):
    """A split's unnormalised result acc [rows, cols], max and sum at flat (row, head, split) indices `at` of
    part [B, H, splits, COLS] and ml [2, B, H, splits] (`half` = B·H·splits; read by `combine_splits`). A split past
    its row's position stores m -inf, sum 0 and acc 0."""
    tl.store(part_ptr + at[:, None] * COLS + cols[None, :], acc, mask=rows_ok[:, None] & (cols[None, :] < COLS))
    tl.store(ml_ptr + at, m, mask=rows_ok)
    tl.store(ml_ptr + half + at, total, mask=rows_ok)


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, pos_ptr, out_ptr, part_ptr, ml_ptr, scale, split_len,
                             q_sb, q_sh, k_ss, k_sh, k_sl, v_ss, v_sh, v_sl, o_sb, o_sh,
                             G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr,
                             SPLIT: tl.constexpr):
    """Program (row b, key/value head g, split s): query heads g * G .. g * G + G - 1 of row b over the positions of
    split s (s * split_len ..) up to pos[b]; with SPLIT, its unnormalised result, max and sum for `combine_splits`."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    end = tl.minimum(tl.load(pos_ptr + b) + 1, (split + 1) * split_len)  # past the split's last visible position
    rows = tl.arange(0, BLOCK_G)
    heads = g * G + rows
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b.to(tl.int64) * q_sb + heads[:, None] * q_sh + d[None, :],
                mask=(rows[:, None] < G) & (d[None, :] < D), other=0.0)
    k_base = k_ptr + slot * k_ss + g * k_sh
    v_base = v_ptr + slot * v_ss + g * v_sh
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # online softmax per query head
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    # `while` rather than `for ... in range(start, end, BLOCK)`: Triton 3.6's interpreter takes no runtime loop bound
    start = split * split_len
    while start < end:
        n = start + tl.arange(0, BLOCK)
        visible = n < end
        k = tl.load(k_base + n[:, None] * k_sl + d[None, :], mask=visible[:, None] & (d[None, :] < D), other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        p, alpha, m, total = online_softmax_step(s, visible, scale, m, total)
        v = tl.load(v_base + n[:, None] * v_sl + dv[None, :], mask=visible[:, None] & (dv[None, :] < DV), other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        start += BLOCK
    head_ok = rows < G
    if SPLIT:
        H = tl.num_programs(1) * G
        at = (b.to(tl.int64) * H + heads) * tl.num_programs(2) + split
        store_split(part_ptr, ml_ptr, at, tl.num_programs(0) * H * tl.num_programs(2), acc, m, total, head_ok, dv, DV)
    else:
        out = acc / total[:, None]
        tl.store(out_ptr + b.to(tl.int64) * o_sb + heads[:, None] * o_sh + dv[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & (dv[None, :] < DV))


def split_positions(programs: int, span: int, block: int) -> tuple[int, int]:
    """(splits, split_len): each row's positions cut into `splits` runs of `split_len` (a multiple of `block`), enough
    for about PROGRAMS programs in all where rows are few and long (flash-decoding: a long generation's last few
    sequences), none shorter than SPLIT_MIN positions; one split where `programs` already fill the GPU."""
    splits = max(1, min(triton.cdiv(span, SPLIT_MIN), PROGRAMS // max(programs, 1)))
    split_len = triton.cdiv(triton.cdiv(span, splits), block) * block
    return triton.cdiv(span, split_len), split_len


def combine_splits(part: torch.Tensor, ml: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Splits' unnormalised results part [B, H, splits, dv] with their maxima and sums ml [2, B, H, splits] ->
    [B, H, dv] in `dtype` (split 0 is never empty: it holds position 0)."""
    m, total = ml
    weight = torch.exp(m - m.amax(dim=-1, keepdim=True))
    return ((part * weight[..., None]).sum(dim=2) / (total * weight).sum(dim=-1)[..., None]).to(dtype)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: torch.Tensor,
                     pos: torch.Tensor, span: int) -> torch.Tensor:
    """The attention of each row's query to its slot's cache (module docstring). Triton on CUDA, the torch reference
    on CPU."""
    _check(q, k_cache, v_cache, slot, pos)
    if not use_triton(q):
        return decode_attention_reference(q, k_cache, v_cache, slot, pos, span)
    if q.stride(2) != 1:
        q = q.contiguous()
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("decode_attention reads caches whose last dimension is contiguous")
    B, H, D = q.shape
    kv_heads, DV = k_cache.shape[1], v_cache.shape[3]
    out = torch.empty(B, H, DV, dtype=q.dtype, device=q.device)
    if not B:
        return out
    splits, split_len = split_positions(B * kv_heads, span, BLOCK_N)
    G = H // kv_heads
    part = ml = out  # unused without splits
    if splits > 1:
        part = torch.empty(B, H, splits, DV, dtype=torch.float32, device=q.device)
        ml = torch.empty(2, B, H, splits, dtype=torch.float32, device=q.device)
    _decode_attention_kernel[(B, kv_heads, splits)](
        q, k_cache, v_cache, slot, pos, out, part, ml, D ** -0.5, split_len, q.stride(0), q.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], out.stride(0), out.stride(1), G=G, D=D, DV=DV,
        BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_D=max(16, triton.next_power_of_2(D)),
        BLOCK_DV=max(16, triton.next_power_of_2(DV)), BLOCK=BLOCK_N, IEEE=q.dtype == torch.float32,
        SPLIT=splits > 1, num_warps=4)
    return combine_splits(part, ml, q.dtype) if splits > 1 else out
