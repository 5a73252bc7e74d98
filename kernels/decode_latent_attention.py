"""One query token per sequence attending to its sequence's cached MLA latents, read in place by slot: the rollout's
decode attention for Multi-head Latent Attention (services/trainer/model/mla.py `attend_latent`).

    decode_latent_attention(q_latent [B, H, r], q_rope [B, H, dr], latent_cache [S, L, r], rope_cache [S, L, dr],
                            slot [B] int64, pos [B] int64, span: int, scale: float) -> [B, H, r]

kv_b_proj's key half is already absorbed into q_latent, so every head scores the latents directly:
score(h, n) = (q_latent[h] · latent[n] + q_rope[h] · k_rope[n]) · scale, softmax over positions 0 .. pos[b] of slot
slot[b], and the result is the probability-weighted sum of the latents (kv_b_proj's value half applied by the caller).
All H heads share one latent per position (multi-query attention with keys of r + dr and values of r). Products of
the operands' dtype accumulate in fp32; the probabilities are rounded to the latents' dtype before they weight them
(as FlashAttention rounds P before P·V); the result is in q_latent's dtype. `span` > every pos: how many positions the
reference gathers (the decode step's bucket); the kernel reads each row's pos[b] + 1.

Why a kernel: in torch ops the batch's latents are first gathered by slot (`latent_cache[slot, :span]`, a copy of
B x span x (r + dr) each layer and step), then read again by two batched GEMMs and a masked softmax. Here a program
per (row, block of heads) reads that slot's latents in place, once per head block, with an online softmax over
blocks of positions (both products on the tensor cores), and stops at the row's own length. The head block and
position block are autotuned (key: the head count and the two dims). Where rows are few and long, their positions
are split over programs too (kernels/decode_attention.py `split_positions`, `combine_splits`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import autotune, use_triton
from kernels.decode_attention import combine_splits, online_softmax_step, split_positions, store_split

# (heads, positions) per block, warps, stages. 64 x 64 on 8 warps was the fastest of 60 on an H200 (within 1%) at
# each shape measured (bench/RESULTS.md); the first, the smallest, is the interpreter's (`autotune_configs`)
_CONFIGS = [triton.Config({"BLOCK_H": bh, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bh, bn, w, s in ((16, 32, 4, 2), (64, 64, 8, 2), (64, 128, 8, 3), (64, 32, 8, 2), (32, 64, 8, 2))]


def _check(q_latent: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
           slot: torch.Tensor, pos: torch.Tensor) -> None:
    if q_latent.dim() != 3 or q_rope.shape[:2] != q_latent.shape[:2] or q_rope.dim() != 3:
        raise ValueError(f"decode_latent_attention wants q_latent [B, H, r] and q_rope [B, H, dr], got "
                         f"{tuple(q_latent.shape)} and {tuple(q_rope.shape)}")
    if (latent_cache.dim() != 3 or rope_cache.shape[:2] != latent_cache.shape[:2]
            or latent_cache.shape[2] != q_latent.shape[2] or rope_cache.shape[2] != q_rope.shape[2]):
        raise ValueError(f"decode_latent_attention: queries of dims {q_latent.shape[2]} + {q_rope.shape[2]} cannot "
                         f"read caches {tuple(latent_cache.shape)} and {tuple(rope_cache.shape)} ([S, L, r], "
                         "[S, L, dr])")
    if slot.shape != (q_latent.shape[0],) or pos.shape != (q_latent.shape[0],):
        raise ValueError(f"decode_latent_attention wants slot and pos of shape [{q_latent.shape[0]}], got "
                         f"{tuple(slot.shape)} and {tuple(pos.shape)}")


def bmm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched a @ b accumulated and returned in fp32: on CUDA straight from bf16/fp16 operands (`bmm`'s out_dtype),
    elsewhere through fp32 copies (the CPU kernel has no such variant)."""
    if a.dtype != torch.float32 and a.is_cuda:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def decode_latent_attention_reference(q_latent: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
                                      rope_cache: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor, span: int,
                                      scale: float) -> torch.Tensor:
    """Same contract as `decode_latent_attention`, in torch ops: the slots' first `span` positions gathered, then
    scores, a masked softmax and the weighted sum as batched GEMMs."""
    _check(q_latent, q_rope, latent_cache, rope_cache, slot, pos)
    latent, k_rope = latent_cache[slot, :span], rope_cache[slot, :span]  # [B, span, r], [B, span, dr]
    scores = (bmm_fp32(q_latent, latent.transpose(1, 2)) + bmm_fp32(q_rope, k_rope.transpose(1, 2))) * scale
    visible = torch.arange(span, device=q_latent.device)[None, :] <= pos[:, None]
    weights = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(dim=-1)
    return bmm_fp32(weights.to(latent.dtype), latent).to(q_latent.dtype)


@autotune(_CONFIGS, key=["H", "R", "DR"])
@triton.jit
def _decode_latent_attention_kernel(ql_ptr, qr_ptr, lat_ptr, rope_ptr, slot_ptr, pos_ptr, out_ptr, part_ptr, ml_ptr,
                                    scale, H, split_len, ql_sb, ql_sh, qr_sb, qr_sh, lat_ss, lat_sl, rope_ss, rope_sl,
                                    o_sb, o_sh, R: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr,
                                    BLOCK_DR: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr,
                                    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (row b, head block, split s): heads hb * BLOCK_H .. + BLOCK_H - 1 of row b over the positions of split
    s (s * split_len ..) up to pos[b]; with SPLIT, its unnormalised result, max and sum for `combine_splits`."""
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    head_ok = heads < H
    slot = tl.load(slot_ptr + b).to(tl.int64)
    end = tl.minimum(tl.load(pos_ptr + b) + 1, (split + 1) * split_len)  # past the split's last visible position
    r = tl.arange(0, BLOCK_R)
    dr = tl.arange(0, BLOCK_DR)
    b64 = b.to(tl.int64)
    q_lat = tl.load(ql_ptr + b64 * ql_sb + heads[:, None] * ql_sh + r[None, :],
                    mask=head_ok[:, None] & (r[None, :] < R), other=0.0)
    q_rope = tl.load(qr_ptr + b64 * qr_sb + heads[:, None] * qr_sh + dr[None, :],
                     mask=head_ok[:, None] & (dr[None, :] < DR), other=0.0)
    lat_base = lat_ptr + slot * lat_ss
    rope_base = rope_ptr + slot * rope_ss
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # online softmax per head
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    # `while` rather than `for ... in range(start, end, BLOCK_N)`: Triton 3.6's interpreter takes no runtime loop bound
    start = split * split_len
    while start < end:
        n = start + tl.arange(0, BLOCK_N)
        visible = n < end
        lat = tl.load(lat_base + n[:, None] * lat_sl + r[None, :], mask=visible[:, None] & (r[None, :] < R),
                      other=0.0)
        k_rope = tl.load(rope_base + n[:, None] * rope_sl + dr[None, :], mask=visible[:, None] & (dr[None, :] < DR),
                         other=0.0)
        if IEEE:
            s = (tl.dot(q_lat, tl.trans(lat), input_precision="ieee")
                 + tl.dot(q_rope, tl.trans(k_rope), input_precision="ieee"))
        else:
            s = tl.dot(q_lat, tl.trans(lat)) + tl.dot(q_rope, tl.trans(k_rope))
        p, alpha, m, total = online_softmax_step(s, visible, scale, m, total)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, lat, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat)
        start += BLOCK_N
    if SPLIT:
        at = (b64 * H + heads) * tl.num_programs(2) + split
        store_split(part_ptr, ml_ptr, at, tl.num_programs(0) * H * tl.num_programs(2), acc, m, total, head_ok, r, R)
    else:
        out = acc / total[:, None]
        tl.store(out_ptr + b64 * o_sb + heads[:, None] * o_sh + r[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=head_ok[:, None] & (r[None, :] < R))


def decode_latent_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
                            rope_cache: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor, span: int,
                            scale: float) -> torch.Tensor:
    """The attention of each row's heads to its slot's latents (module docstring). Triton on CUDA, the torch
    reference on CPU."""
    _check(q_latent, q_rope, latent_cache, rope_cache, slot, pos)
    if not use_triton(q_latent):
        return decode_latent_attention_reference(q_latent, q_rope, latent_cache, rope_cache, slot, pos, span, scale)
    if latent_cache.stride(2) != 1 or rope_cache.stride(2) != 1:
        raise ValueError("decode_latent_attention reads caches whose last dimension is contiguous")
    q_latent = q_latent if q_latent.stride(2) == 1 else q_latent.contiguous()
    q_rope = q_rope if q_rope.stride(2) == 1 else q_rope.contiguous()
    B, H, R = q_latent.shape
    DR = q_rope.shape[2]
    out = torch.empty(B, H, R, dtype=q_latent.dtype, device=q_latent.device)
    if not B:
        return out
    # as many programs a row as head blocks of the configs' usual 64 heads
    splits, split_len = split_positions(B * triton.cdiv(H, 64), span, 64)
    part = ml = out  # unused without splits
    if splits > 1:
        part = torch.empty(B, H, splits, R, dtype=torch.float32, device=q_latent.device)
        ml = torch.empty(2, B, H, splits, dtype=torch.float32, device=q_latent.device)
    _decode_latent_attention_kernel[lambda meta: (B, triton.cdiv(H, meta["BLOCK_H"]), splits)](
        q_latent, q_rope, latent_cache, rope_cache, slot, pos, out, part, ml, scale, H, split_len, q_latent.stride(0),
        q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), latent_cache.stride(0), latent_cache.stride(1),
        rope_cache.stride(0), rope_cache.stride(1), out.stride(0), out.stride(1), R=R, DR=DR,
        BLOCK_R=max(16, triton.next_power_of_2(R)), BLOCK_DR=max(16, triton.next_power_of_2(DR)),
        IEEE=q_latent.dtype == torch.float32, SPLIT=splits > 1)
    return combine_splits(part, ml, q_latent.dtype) if splits > 1 else out
