"""QK-norm + RoPE of the projected attention heads, one kernel forward and one backward.

    head_norm_rope(q [T, Hq, d], k [T, Hk, d], q_scale, k_scale, eps, position_ids [T], inv_freq [d/2]) -> (q, k)

Semantics (`head_norm_rope_reference`, which the model runs off CUDA and `model.compile` compiles there):
- QK-norm, when the scales are given: `F.rms_norm` over head_dim with the fp32 scale cast to the heads' dtype. torch's
  kernels (CPU and CUDA) compute x · rstd · weight in fp32 and round once to the heads' dtype; so does this kernel.
- RoPE (`apply_rope`): in fp32, pairs (i, i + d/2) rotated by the angle position · inv_freq[i],
  rounded once to the heads' dtype.

One program owns BLOCK_T tokens: it computes their cos/sin once (fp32, the same product of the same inv_freq; libdevice
sin/cos on the GPU, accurate for the angles of long positions), then walks over every q head and every k head in
[BLOCK_T, BLOCK_H, d/2] tiles, reading and writing each element once. Backward re-reads q and k (the inputs, which it
keeps; no per-row statistics are saved: rstd is recomputed from the same tile) and the output gradients, and writes
dq, dk and per-program partial sums of the scales' gradients, which torch sums afterwards in a fixed order
(deterministic, no float atomics). Where the reference rounds on the way back, so does the kernel (the gradient
reaching the norm, in the heads' dtype), except the scales' gradients: the reference's are those of the bf16-cast
scale, rounded to bf16; the kernel keeps the fp32 sum.

On an H100 at q [8192, 32, 128], k [8192, 4, 128] bf16 (bench/bench_head_norm_rope.py, two calls; bench/RESULTS.md):
forward 0.094-0.118 ms (a device copy of its bytes: 0.103 ms), forward + backward 0.388-0.572 ms, against
0.743-0.982 ms for the reference under torch.compile in the same calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels._triton import TRITON_INTERPRETED, autotune, use_triton

# The interpreter runs tl.* in numpy but has no libdevice; compiled, tl.cos / tl.sin may lower to the approximate
# hardware instructions, whose error grows with the angle, so the GPU takes libdevice's (as torch's CUDA cos does).
_LIBDEVICE = tl.constexpr(not TRITON_INTERPRETED)
_CONFIGS = [triton.Config({"BLOCK_T": bt, "BLOCK_H": bh}, num_warps=w)
            for bt, bh, w in ((4, 4, 4), (2, 4, 4), (4, 4, 2), (8, 4, 4), (4, 8, 4), (16, 2, 4), (32, 1, 4),
                              (8, 8, 8))]
# Sizes the per-program partial sums of the scales' gradients for the config with the most programs.
_MIN_BLOCK_T = min(c.kwargs["BLOCK_T"] for c in _CONFIGS)


def apply_rope(x: torch.Tensor, position_ids: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; rotates pairs (i, i + d/2) by angle pos * inv_freq[i] (computed in fp32)."""
    angles = position_ids.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, d/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def head_norm_rope_reference(q: torch.Tensor, k: torch.Tensor, q_scale: torch.Tensor | None,
                             k_scale: torch.Tensor | None, eps: float, position_ids: torch.Tensor,
                             inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """QK-norm (when the scales are given), then RoPE, in torch ops. The scale is cast to the heads' dtype: under
    autocast the heads are bf16 and the scale fp32, and rms_norm runs its fused kernel only for one dtype (otherwise a
    composite path that also warns from C++ on every call, ~1.4 ms of host time per call on an H100 host)."""
    if q_scale is not None:
        q = F.rms_norm(q, (q.shape[-1],), q_scale.to(q.dtype), eps)
        k = F.rms_norm(k, (k.shape[-1],), k_scale.to(k.dtype), eps)
    return apply_rope(q, position_ids, inv_freq), apply_rope(k, position_ids, inv_freq)


def supports_head_dim(d: int) -> bool:
    """The kernels tile a head as two power-of-two halves."""
    return d >= 2 and d & (d - 1) == 0


def _check(q, k, q_scale, k_scale, position_ids, inv_freq) -> None:
    for name, x in (("q", q), ("k", k)):
        if x.dim() != 3:
            raise ValueError(f"head_norm_rope wants {name} [tokens, heads, head_dim], got {tuple(x.shape)}")
    T, _, d = q.shape
    if k.shape[0] != T or k.shape[2] != d:
        raise ValueError(f"head_norm_rope wants k [{T}, heads, {d}] to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    if k.dtype != q.dtype:
        raise ValueError(f"head_norm_rope wants k in q's dtype {q.dtype}, got {k.dtype}")
    if not supports_head_dim(d):
        raise ValueError(f"head_norm_rope wants head_dim a power of two (64, 128, 256), got q {tuple(q.shape)}")
    if (q_scale is None) != (k_scale is None):
        raise ValueError("head_norm_rope wants both q_scale and k_scale (QK-norm) or neither (RoPE only)")
    for name, s in (("q_scale", q_scale), ("k_scale", k_scale)):
        if s is not None and s.shape != (d,):
            raise ValueError(f"head_norm_rope wants {name} [head_dim] = [{d}], got {tuple(s.shape)}")
    if position_ids.shape != (T,):
        raise ValueError(f"head_norm_rope wants position_ids [tokens] = [{T}], got {tuple(position_ids.shape)}")
    if inv_freq.shape != (d // 2,):
        raise ValueError(f"head_norm_rope wants inv_freq [head_dim / 2] = [{d // 2}], got {tuple(inv_freq.shape)}")


@triton.jit
def _to(x, dtype: tl.constexpr):
    """fp32 x rounded to nearest-even in `dtype`. The interpreter truncates fp32 -> bf16, so there the rounding is
    done on the bits first (the truncation that follows is then exact); compiled, the conversion instruction rounds."""
    if _LIBDEVICE or dtype != tl.bfloat16:
        return x.to(dtype)
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True).to(dtype)


@triton.jit
def _cos_sin(pos_ptr, inv_freq_ptr, rows, rmask, HALF: tl.constexpr):
    """[BLOCK_T, 1, HALF] fp32 cos and sin of position · inv_freq, as `apply_rope` forms the angle."""
    pos = tl.load(pos_ptr + rows, mask=rmask, other=0).to(tl.float32)
    angle = pos[:, None] * tl.load(inv_freq_ptr + tl.arange(0, HALF)).to(tl.float32)[None, :]
    if _LIBDEVICE:
        cos, sin = libdevice.cos(angle), libdevice.sin(angle)
    else:
        cos, sin = tl.cos(angle), tl.sin(angle)
    return cos[:, None, :], sin[:, None, :]


@triton.jit
def _rstd(x1, x2, eps, HALF: tl.constexpr):
    """[BLOCK_T, BLOCK_H, 1] 1 / sqrt(mean(x²) + eps) over the head's two halves."""
    ms = (tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)) / (2 * HALF) + eps
    if _LIBDEVICE:
        rstd = libdevice.rsqrt(ms)
    else:
        rstd = tl.rsqrt(ms)
    return rstd[:, :, None]


@triton.jit
def _tile(rows, rmask, h0, H: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Offsets of the first halves of heads h0 .. h0 + BLOCK_H of the rows, and their mask: [BLOCK_T, BLOCK_H, HALF]."""
    heads = h0 + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, HALF)
    offs = (rows.to(tl.int64)[:, None, None] * H + heads[None, :, None]) * (2 * HALF) + cols[None, None, :]
    return offs, rmask[:, None, None] & (heads < H)[None, :, None]


@triton.jit
def _scale_halves(scale_ptr, dtype, HALF: tl.constexpr):
    """The scale rounded to the heads' dtype (as the reference casts it), in fp32: two [1, 1, HALF] halves."""
    cols = tl.arange(0, HALF)
    w1 = _to(tl.load(scale_ptr + cols).to(tl.float32), dtype).to(tl.float32)
    w2 = _to(tl.load(scale_ptr + HALF + cols).to(tl.float32), dtype).to(tl.float32)
    return w1[None, None, :], w2[None, None, :]


@triton.jit
def _fwd_heads(x_ptr, out_ptr, scale_ptr, rows, rmask, cos, sin, H: tl.constexpr, eps, HALF: tl.constexpr,
               BLOCK_H: tl.constexpr, HAS_SCALE: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    if HAS_SCALE:
        w1, w2 = _scale_halves(scale_ptr, dtype, HALF)
    for h0 in range(0, H, BLOCK_H):
        offs, mask = _tile(rows, rmask, h0, H, HALF, BLOCK_H)
        x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALE:  # torch's order: (x · rstd) · weight, rounded once
            rstd = _rstd(x1, x2, eps, HALF)
            x1 = _to(x1 * rstd * w1, dtype).to(tl.float32)
            x2 = _to(x2 * rstd * w2, dtype).to(tl.float32)
        tl.store(out_ptr + offs, _to(x1 * cos - x2 * sin, dtype), mask=mask)
        tl.store(out_ptr + offs + HALF, _to(x2 * cos + x1 * sin, dtype), mask=mask)


@autotune(_CONFIGS, key=["HQ", "HK", "HALF", "HAS_SCALE"])
@triton.jit
def _head_norm_rope_fwd_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, q_scale_ptr, k_scale_ptr, pos_ptr, inv_freq_ptr,
                               T, eps, HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, HAS_SCALE: tl.constexpr,
                               BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    cos, sin = _cos_sin(pos_ptr, inv_freq_ptr, rows, rmask, HALF)  # once per token, for all its q and k heads
    _fwd_heads(q_ptr, q_out_ptr, q_scale_ptr, rows, rmask, cos, sin, HQ, eps, HALF, BLOCK_H, HAS_SCALE)
    _fwd_heads(k_ptr, k_out_ptr, k_scale_ptr, rows, rmask, cos, sin, HK, eps, HALF, BLOCK_H, HAS_SCALE)


@triton.jit
def _bwd_heads(x_ptr, grad_ptr, dx_ptr, scale_ptr, dscale_partial_ptr, rows, rmask, cos, sin, H: tl.constexpr, eps,
               HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HAS_SCALE: tl.constexpr):
    """With n = x · rstd and y = n · w the normed head, dy = RoPE's transpose applied to the output gradient, rounded
    to the heads' dtype as the reference's `x.float()` rounds it; then dx = rstd (dy·w - n · mean(dy·w · n)), and this
    program's rows add Σ dy · n to the scale's gradient."""
    dtype = dx_ptr.dtype.element_ty
    if HAS_SCALE:
        w1, w2 = _scale_halves(scale_ptr, dtype, HALF)
        # element-wise accumulators, reduced once at the end: a reduction over tokens per tile costs shared memory
        dw1 = tl.zeros([BLOCK_T, BLOCK_H, HALF], dtype=tl.float32)
        dw2 = tl.zeros([BLOCK_T, BLOCK_H, HALF], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs, mask = _tile(rows, rmask, h0, H, HALF, BLOCK_H)
        g1 = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g2 = tl.load(grad_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
        dy1 = _to(g1 * cos + g2 * sin, dtype).to(tl.float32)
        dy2 = _to(g2 * cos - g1 * sin, dtype).to(tl.float32)
        if HAS_SCALE:
            x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(x_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
            rstd = _rstd(x1, x2, eps, HALF)
            n1, n2 = x1 * rstd, x2 * rstd
            dw1 += dy1 * n1
            dw2 += dy2 * n2
            dn1, dn2 = dy1 * w1, dy2 * w2
            c = ((tl.sum(dn1 * n1, axis=2) + tl.sum(dn2 * n2, axis=2)) / (2 * HALF))[:, :, None]
            dy1 = rstd * (dn1 - n1 * c)
            dy2 = rstd * (dn2 - n2 * c)
        tl.store(dx_ptr + offs, _to(dy1, dtype), mask=mask)
        tl.store(dx_ptr + offs + HALF, _to(dy2, dtype), mask=mask)
    if HAS_SCALE:
        cols = tl.arange(0, HALF)
        partial = dscale_partial_ptr + tl.program_id(0).to(tl.int64) * (2 * HALF)
        tl.store(partial + cols, tl.sum(tl.sum(dw1, axis=1), axis=0))
        tl.store(partial + HALF + cols, tl.sum(tl.sum(dw2, axis=1), axis=0))


@autotune(_CONFIGS, key=["HQ", "HK", "HALF", "HAS_SCALE"],
                 reset_to_zero=["dq_scale_partial_ptr", "dk_scale_partial_ptr"])  # configs run different grids
@triton.jit
def _head_norm_rope_bwd_kernel(q_ptr, k_ptr, dq_out_ptr, dk_out_ptr, dq_ptr, dk_ptr, q_scale_ptr, k_scale_ptr,
                               dq_scale_partial_ptr, dk_scale_partial_ptr, pos_ptr, inv_freq_ptr, T, eps,
                               HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, HAS_SCALE: tl.constexpr,
                               BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    cos, sin = _cos_sin(pos_ptr, inv_freq_ptr, rows, rmask, HALF)
    _bwd_heads(q_ptr, dq_out_ptr, dq_ptr, q_scale_ptr, dq_scale_partial_ptr, rows, rmask, cos, sin, HQ, eps, HALF,
               BLOCK_T, BLOCK_H, HAS_SCALE)
    _bwd_heads(k_ptr, dk_out_ptr, dk_ptr, k_scale_ptr, dk_scale_partial_ptr, rows, rmask, cos, sin, HK, eps, HALF,
               BLOCK_T, BLOCK_H, HAS_SCALE)


def _grid(T: int):
    return lambda meta: (triton.cdiv(T, meta["BLOCK_T"]),)


class _HeadNormRopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, q_scale, k_scale, eps, position_ids, inv_freq):
        q, k, position_ids, inv_freq = (t.contiguous() for t in (q, k, position_ids, inv_freq))
        has_scale = q_scale is not None
        scales = (q_scale.contiguous(), k_scale.contiguous()) if has_scale else (q, k)  # unread without scales
        (T, HQ, d), HK = q.shape, k.shape[1]
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        if T > 0:
            _head_norm_rope_fwd_kernel[_grid(T)](q, k, q_out, k_out, *scales, position_ids, inv_freq, T, float(eps),
                                                 HQ=HQ, HK=HK, HALF=d // 2, HAS_SCALE=has_scale)
        # Without QK-norm the backward is RoPE's transpose alone and needs neither input.
        ctx.save_for_backward(*((q, k, *scales) if has_scale else ()), position_ids, inv_freq)
        ctx.has_scale, ctx.eps, ctx.shapes = has_scale, float(eps), (T, HQ, HK, d)
        return q_out, k_out

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        T, HQ, HK, d = ctx.shapes
        if ctx.has_scale:
            q, k, q_scale, k_scale, position_ids, inv_freq = ctx.saved_tensors
        else:
            position_ids, inv_freq = ctx.saved_tensors
        device = position_ids.device
        dtype = grad_q.dtype if grad_q is not None else grad_k.dtype
        grad_q = grad_q.contiguous() if grad_q is not None else torch.zeros(T, HQ, d, dtype=dtype, device=device)
        grad_k = grad_k.contiguous() if grad_k is not None else torch.zeros(T, HK, d, dtype=dtype, device=device)
        if not ctx.has_scale:
            q, k = grad_q, grad_k  # unread
            q_scale, k_scale = grad_q, grad_k
        dq, dk = torch.empty_like(grad_q), torch.empty_like(grad_k)
        n_partial = triton.cdiv(T, _MIN_BLOCK_T) if ctx.has_scale else 1
        partials = torch.zeros(2, n_partial, d, dtype=torch.float32, device=device)
        if T > 0:
            _head_norm_rope_bwd_kernel[_grid(T)](q, k, grad_q, grad_k, dq, dk, q_scale, k_scale, partials[0],
                                                 partials[1], position_ids, inv_freq, T, ctx.eps, HQ=HQ, HK=HK,
                                                 HALF=d // 2, HAS_SCALE=ctx.has_scale)
        if not ctx.has_scale:
            return dq, dk, None, None, None, None, None
        dq_scale, dk_scale = partials.sum(1).unbind(0)
        return dq, dk, dq_scale.to(q_scale.dtype), dk_scale.to(k_scale.dtype), None, None, None


def head_norm_rope(q: torch.Tensor, k: torch.Tensor, q_scale: torch.Tensor | None, k_scale: torch.Tensor | None,
                   eps: float, position_ids: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """QK-norm (when the scales are given) and RoPE of q [T, Hq, d] and k [T, Hk, d] (see the module docstring):
    the Triton kernels on CUDA, the torch reference elsewhere."""
    _check(q, k, q_scale, k_scale, position_ids, inv_freq)
    if not use_triton(q):
        return head_norm_rope_reference(q, k, q_scale, k_scale, eps, position_ids, inv_freq)
    return _HeadNormRopeFunction.apply(q, k, q_scale, k_scale, eps, position_ids, inv_freq)
