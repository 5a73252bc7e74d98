"""FP8 (e4m3) quantisers for the routed experts' grouped GEMM (kernels/fp8_grouped_mm.py), with torch references.

    quantize_rows(x [M, K], recipe) -> (e4m3 [M, K], fp32 scale)
    quantize_weight(w [E, K, N], recipe) -> (e4m3 [E, K, N], the same values as [E, N, K], fp32 scale)

Recipes (the scales are fp32, computed on the device from amaxes: amax / 448, e4m3's largest value):
- "tensorwise": one scale per activation row ([M, 1]) and one per expert weight ([E, 1, 1]). (A row's scale is never
  coarser than one for the whole tensor and costs the same, so activations are scaled per row.)
- "blockwise": DeepSeek-V3's fine-grained scaling (arXiv 2412.19437, section 3.3.2): activations 1x128 along K
  ([M, ceil(K/128)], stored K-block-major), weights 128x128 ([E, ceil(K/128), ceil(N/128)]).

The weight quantiser writes each expert weight in both layouts, because Hopper's fp8 wgmma reads both operands
K-major: the forward reads [E, N, K], backward's dgrad (contracting over N) reads [E, K, N], with the same scales (a
128x128 block transposes with its values). Quotients are divided with correct rounding (`tl.div_rn`): Triton's `/`
compiles to an approximate division on the GPU, which put ~1 value in 4M an ulp off and across an e4m3 rounding
midpoint (bench/RESULTS.md).

Each public function has a torch reference of the same signature (`*_reference`) and, like every kernel here, runs
Triton on CUDA tensors, the reference on CPU tensors, and Triton's interpreter on CPU when TRITON_INTERPRET=1.
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl

from kernels._triton import TRITON_INTERPRETED, next_power_of_2, use_triton

Recipe = Literal["tensorwise", "blockwise"]
RECIPES = ("tensorwise", "blockwise")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_BLOCK = 128  # blockwise: activations 1x128, weights 128x128
EPS = 1e-12  # amax floor: an all-zero row or block gets a tiny scale and quantises to zeros, never 0/0


# ----------------------------------------------------------------------------------------------------------------
# Checks and the torch references


def _check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"FP8 recipe {recipe!r} is not one of {list(RECIPES)}")


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    return amax.float().clamp(min=EPS) / FP8_MAX


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _blocks(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x zero-padded along `dim` to whole 128-blocks and split: [..., n, ...] -> [..., nb, 128, ...]."""
    n = x.shape[dim]
    pad = -n % SCALE_BLOCK
    if pad:
        widths = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, pad]
        x = torch.nn.functional.pad(x, widths)
    return x.unflatten(dim, (-1, SCALE_BLOCK))


def _unblocks(scale: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """Per-block scales repeated to per-element along `dim`, cut to n."""
    return scale.repeat_interleave(SCALE_BLOCK, dim=dim).narrow(dim, 0, n)


def _weight_scale_shape(E: int, rows: int, cols: int, recipe: Recipe) -> tuple[int, int, int]:
    """The scales of E [rows, cols] expert weights: one per expert, or one per 128x128 block."""
    if recipe == "tensorwise":
        return E, 1, 1
    return E, triton.cdiv(rows, SCALE_BLOCK), triton.cdiv(cols, SCALE_BLOCK)


def quantize_rows_reference(x: torch.Tensor, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `quantize_rows`, in torch ops."""
    _check_recipe(recipe)
    if recipe == "tensorwise":
        scale = _scale_of(x.abs().amax(dim=1, keepdim=True)) if x.shape[1] else x.new_ones(x.shape[0], 1).float()
        return _to_fp8(x, scale), scale
    scale = _scale_of(_blocks(x, 1).abs().amax(dim=2))  # [M, Kb]
    scale = scale.t().contiguous().t()  # stored [Kb, M]: the kernel reads one K-block's scales for a row tile at once
    return _to_fp8(x, _unblocks(scale, 1, x.shape[1])), scale


def quantize_weight_reference(w: torch.Tensor, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `quantize_weight`, in torch ops."""
    _check_recipe(recipe)
    E, K, N = w.shape
    if recipe == "tensorwise":
        scale = _scale_of(w.abs().amax(dim=(1, 2), keepdim=True) if w.numel() else w.new_zeros(E, 1, 1))
        q = _to_fp8(w, scale)
    else:
        scale = _scale_of(_blocks(_blocks(w, 2), 1).abs().amax(dim=(2, 4)))  # [E, Kb, Nb]
        q = _to_fp8(w, _unblocks(_unblocks(scale, 1, K), 2, N))
    return q, q.transpose(1, 2).contiguous(), scale


# ----------------------------------------------------------------------------------------------------------------
# Triton


@triton.jit
def _to_e4m3(x, dtype: tl.constexpr, FP8_MAX: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """fp32 -> e4m3, round to nearest even, saturating at +-448. On the GPU the conversion instruction rounds; Triton's
    interpreter (3.6) does not (it ignores bits below the first dropped one and loses the carry into the exponent:
    124.3 becomes 64), so there the value is first rounded onto e4m3's grid in fp32 and the conversion is exact."""
    x = tl.clamp(x, -FP8_MAX, FP8_MAX)
    if ROUND_FIRST:
        bits = x.to(tl.int32, bitcast=True)  # normals: keep 3 of fp32's 23 mantissa bits, ties to even
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
        # e4m3 subnormals are multiples of 2^-9: rint(|x| * 2^9) by the 1.5 * 2^23 trick, the sign put back (-0 too)
        subnormal = ((tl.abs(x) * 512.0 + 12582912.0) - 12582912.0) / 512.0
        subnormal *= tl.where(x < 0, -1.0, 1.0)  # (Triton negates as 0 - x, which loses -0)
        x = tl.where(tl.abs(x) < 0.015625, subnormal, bits.to(tl.float32, bitcast=True))
    return x.to(dtype)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, M, K: tl.constexpr, stride_xm, stride_sm, stride_sk,
                          BLOCKWISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                          FP8_MAX: tl.constexpr, EPS: tl.constexpr, ROUND_FIRST: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    q_rows = q_ptr + rows[:, None].to(tl.int64) * K
    if BLOCKWISE:  # one 1xBLOCK_K block of each row per program; BLOCK_K is the scale block
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < K)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), EPS) / FP8_MAX
        q = _to_e4m3(tl.div_rn(x, scale[:, None]), q_ptr.dtype.element_ty, FP8_MAX, ROUND_FIRST)
        tl.store(q_rows + cols[None, :], q, mask=mask)
        tl.store(s_ptr + rows * stride_sm + tl.program_id(1) * stride_sk, scale, mask=row_ok)
    elif BLOCK_K >= K:  # whole rows held in registers: one read
        cols = tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < K)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), EPS) / FP8_MAX
        q = _to_e4m3(tl.div_rn(x, scale[:, None]), q_ptr.dtype.element_ty, FP8_MAX, ROUND_FIRST)
        tl.store(q_rows + cols[None, :], q, mask=mask)
        tl.store(s_ptr + rows * stride_sm, scale, mask=row_ok)
    else:  # longer rows: an amax pass, then a quantising pass (the second read mostly hits cache)
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        scale = tl.maximum(amax, EPS) / FP8_MAX
        for start in range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            mask = row_ok[:, None] & (cols < K)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            q = _to_e4m3(tl.div_rn(x, scale[:, None]), q_ptr.dtype.element_ty, FP8_MAX, ROUND_FIRST)
            tl.store(q_rows + cols[None, :], q, mask=mask)
        tl.store(s_ptr + rows * stride_sm, scale, mask=row_ok)


@triton.jit
def _quantize_weight_kernel(w_ptr, q_ptr, s_ptr, K, N, stride_se, stride_sk, stride_sn,
                            BLOCKWISE: tl.constexpr, BLOCK: tl.constexpr,
                            FP8_MAX: tl.constexpr, EPS: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """One BLOCKxBLOCK block of one expert's [K, N] weight, quantised into q, laid out as w."""
    nb, kb, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ks = kb * BLOCK + tl.arange(0, BLOCK)
    ns = nb * BLOCK + tl.arange(0, BLOCK)
    base = e.to(tl.int64) * K * N
    mask = (ks < K)[:, None] & (ns < N)[None, :]
    w = tl.load(w_ptr + base + ks[:, None] * N + ns[None, :], mask=mask, other=0.0).to(tl.float32)
    if BLOCKWISE:
        scale = tl.maximum(tl.max(tl.max(tl.abs(w), axis=1), axis=0), EPS) / FP8_MAX
        tl.store(s_ptr + e * stride_se + kb * stride_sk + nb * stride_sn, scale)
    else:  # the expert's scale, its amax computed beforehand (block strides 0)
        scale = tl.load(s_ptr + e * stride_se + kb * stride_sk + nb * stride_sn)
    q = _to_e4m3(tl.div_rn(w, scale), q_ptr.dtype.element_ty, FP8_MAX, ROUND_FIRST)
    tl.store(q_ptr + base + ks[:, None] * N + ns[None, :], q, mask=mask)


@triton.jit
def _transpose_bytes_kernel(q_ptr, qt_ptr, K, N, BLOCK: tl.constexpr):
    """One BLOCKxBLOCK block of one expert's [K, N] bytes, read transposed and stored row by row into [N, K]."""
    nb, kb, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ks = kb * BLOCK + tl.arange(0, BLOCK)
    ns = nb * BLOCK + tl.arange(0, BLOCK)
    base = e.to(tl.int64) * K * N
    mask = (ns < N)[:, None] & (ks < K)[None, :]
    t = tl.load(q_ptr + base + ks[None, :] * N + ns[:, None], mask=mask, other=0)
    tl.store(qt_ptr + base + ns[:, None] * K + ks[None, :], t, mask=mask)


_ROW_IN_REGISTERS = 4096


def quantize_rows(x: torch.Tensor, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (e4m3 [M, K], fp32 scales) with x ~= q * scale: per row ([M, 1], tensorwise)
    or per 1x128 block along K ([M, ceil(K/128)], blockwise; stored K-block-major). On the device, no host sync."""
    _check_recipe(recipe)
    if x.dim() != 2:
        raise ValueError(f"quantize_rows wants x [M, K], got {tuple(x.shape)}")
    if not use_triton(x):
        return quantize_rows_reference(x, recipe)
    x = x if x.stride(1) == 1 else x.contiguous()
    M, K = x.shape
    q = torch.empty(M, K, dtype=FP8, device=x.device)
    blockwise = recipe == "blockwise"
    kb = triton.cdiv(K, SCALE_BLOCK) if blockwise else 1
    scale = torch.empty(kb, M, dtype=torch.float32, device=x.device).t()  # [M, kb] view of [kb, M]
    if M and K:
        # tensorwise: a row of up to 4096 in one program's registers (32 values per thread), read once; that was 1.2x
        # (K=2048) to 1.8x (K=768) faster on an H100 than 8 rows per program read twice (a probe whose timing
        # included each call's launch; bench/RESULTS.md)
        whole_row = not blockwise and K <= _ROW_IN_REGISTERS
        block_m = 16 if blockwise else 1 if whole_row else 8
        block_k = SCALE_BLOCK if blockwise else next_power_of_2(K) if whole_row else 1024
        grid = (triton.cdiv(M, block_m), kb)
        _quantize_rows_kernel[grid](x, q, scale, M, K, x.stride(0), scale.stride(0), scale.stride(1),
                                    BLOCKWISE=blockwise, BLOCK_M=block_m, BLOCK_K=block_k,
                                    FP8_MAX=FP8_MAX, EPS=EPS, ROUND_FIRST=TRITON_INTERPRETED, num_warps=4)
    elif M:
        scale.fill_(EPS / FP8_MAX)
    return q, scale


def quantize_weight(w: torch.Tensor, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert weights w [E, K, N] (any float dtype) -> (q [E, K, N], q_t [E, N, K], scale) in e4m3, q_t the same
    values K-contiguous (the forward's operand; q is dgrad's). scale: fp32 [E, 1, 1] (tensorwise) or
    [E, ceil(K/128), ceil(N/128)] (blockwise). On the device, no host sync."""
    _check_recipe(recipe)
    if w.dim() != 3:
        raise ValueError(f"quantize_weight wants w [E, K, N], got {tuple(w.shape)}")
    if not use_triton(w):
        return quantize_weight_reference(w, recipe)
    w = w.contiguous()
    E, K, N = w.shape
    q = torch.empty(E, K, N, dtype=FP8, device=w.device)
    qt = torch.empty(E, N, K, dtype=FP8, device=w.device)
    blockwise = recipe == "blockwise"
    kb, nb = triton.cdiv(K, SCALE_BLOCK), triton.cdiv(N, SCALE_BLOCK)
    if blockwise:
        scale = torch.empty(E, kb, nb, dtype=torch.float32, device=w.device)
    else:  # one fused abs-max reduction per expert
        scale = _scale_of(torch.linalg.vector_norm(w, ord=float("inf"), dim=(1, 2))).view(E, 1, 1)
    strides = (scale.stride(0), scale.stride(1), scale.stride(2)) if blockwise else (scale.stride(0), 0, 0)
    # Two passes: quantise into [K, N], then copy those bytes transposed into [N, K] (the same values with the same
    # scales: a 128x128 scale block transposes with its values). A transposed masked fp8 store miscompiled on sm_90
    # with Triton 3.6 (tests/test_kernels_fp8_grouped_mm.py caught it at N=192), so the copy reads transposed and
    # stores rows, as bytes. Reading the 1-byte copy instead of the weight again was ~1.5x faster on an H100 than
    # quantising the weight a second time, transposed; one pass writing both layouts 1.4x slower (probes whose timing
    # included the launch; bench/RESULTS.md).
    if w.numel():
        grid = (nb, kb, E)
        _quantize_weight_kernel[grid](w, q, scale, K, N, *strides, BLOCKWISE=blockwise, BLOCK=SCALE_BLOCK,
                                      FP8_MAX=FP8_MAX, EPS=EPS, ROUND_FIRST=TRITON_INTERPRETED, num_warps=8)
        _transpose_bytes_kernel[grid](q.view(torch.uint8), qt.view(torch.uint8), K, N, BLOCK=SCALE_BLOCK, num_warps=8)
    return q, qt, scale
