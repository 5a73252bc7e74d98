"""FP8 (e4m3) grouped GEMM for the routed experts, with its quantisers and an autograd linear on top.

    fp8_grouped_mm(a [M, K] e4m3, a_scale, b [E, N, K] e4m3, b_scale, offs [E] int32, recipe, fast_accum=False)
        -> [M, N] bf16
        out[offs[g-1]:offs[g]] = (a[offs[g-1]:offs[g]] @ b[g].T) * scales;  rows from offs[E-1] on: zero
    fp8_grouped_linear(x [M, K], w [E, K, N], offs, recipe, w_quantized=None) -> [M, N] bf16
        (autograd; quantises on the device, the weight unless `w_quantized` holds quantize_weight(w, recipe))

Recipes (the scales are fp32, computed on the device from amaxes: amax / 448, e4m3's largest value):
- "tensorwise": one scale per activation row (a_scale [M, 1]) and one per expert weight (b_scale [E, 1, 1]); the
  scales are applied once, in the epilogue. With `fast_accum` the tensor cores accumulate the whole K in their own
  reduced-precision fp8 accumulator on Hopper (Triton's default for fp8 there); without it (the default, as
  torch._scaled_mm's `use_fast_accum=False`) each 128-deep K step's product is added to an fp32 accumulator, as
  blockwise does. The linear below uses fast accumulation in forward and split accumulation in dgrad, as Transformer
  Engine's FP8 recipes do (its `fp8_gemm_fprop` / `fp8_gemm_dgrad`). (A row's scale is never coarser than one for
  the whole tensor and costs the same, so activations are scaled per row.)
- "blockwise": DeepSeek-V3's fine-grained scaling (arXiv 2412.19437, section 3.3.2): activations 1x128 along K
  (a_scale [M, ceil(K/128)]), weights 128x128 (b_scale [E, ceil(N/128), ceil(K/128)]). Each 128-deep K step's
  partial product leaves the tensor cores and is added to an fp32 accumulator with its two scales, which also bounds
  the span of the tensor cores' own (reduced-precision on Hopper) fp8 accumulation to 128 products.

`b` is the weight in "NK" layout (K contiguous): Hopper's fp8 wgmma reads both operands K-major. The quantiser writes
each expert weight [K, N] in both layouts, so backward's dgrad (dX = dY @ W^T, contracting over N) finds
its operand, W itself, already K-major, with the same scales (the 128x128 blocks transpose with it).

Blockwise loads its tiles with the Hopper TMA unit through tensor descriptors built on the host (Triton's interpreter
emulates them on CPU); tensorwise through masked pointer loads. No host sync: the groups are read from `offs` on the
device. The grid is sized by an upper bound on the row tiles, ceil(M / BLOCK_M) + E + 1 (each group adds at most one
partial tile; the +1 is the tail past offs[E-1], which is written with zeros), and each program finds its group by a
prefix sum over the per-group tile counts; programs past the last tile exit at once. Preconditions: offs
non-decreasing, offs[E-1] <= M, K and N multiples of 16.

The autograd function quantises x and w in forward (w only when not given quantised: the experts quantise each weight
once per optimizer step when a step reads it more than once, services/trainer/model/moe/experts.py) and keeps x
(bf16, as the bf16 path does) and the fp8 weight.
Backward: dgrad with this kernel (dY quantised to e4m3 by the same recipe, along N); wgrad dW[g] = X_g^T dY_g in
bf16 through torch._grouped_mm (an FP8 wgrad would need X and dY quantised along M, the token dimension).

Each public function has a torch reference of the same signature (`*_reference`) and, like every kernel here, runs
Triton on CUDA tensors, the reference on CPU tensors, and Triton's interpreter on CPU when TRITON_INTERPRET=1.
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels._triton import TRITON_INTERPRETED, autotune_configs, next_power_of_2, use_triton

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


def _check_mm(a, a_scale, b, b_scale, offs, recipe) -> None:
    _check_recipe(recipe)
    if a.dtype != FP8 or b.dtype != FP8:
        raise ValueError(f"fp8_grouped_mm wants e4m3 operands, got a {a.dtype} and b {b.dtype}")
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[2]:
        raise ValueError(f"fp8_grouped_mm wants a [M, K] and b [E, N, K] (each expert's weight with K contiguous), "
                         f"got a {tuple(a.shape)} and b {tuple(b.shape)}")
    (M, K), (E, N, _) = a.shape, b.shape
    if K % 16 or N % 16:
        raise ValueError(f"fp8_grouped_mm needs K and N to be multiples of 16 (16-byte fp8 rows), got K={K} N={N}")
    if offs.shape != (E,) or offs.dtype != torch.int32:
        raise ValueError(f"fp8_grouped_mm wants offs: int32 [E] = [{E}] cumulative rows per group, "
                         f"got {offs.dtype} {tuple(offs.shape)}")
    want_a = (M, 1) if recipe == "tensorwise" else (M, triton.cdiv(K, SCALE_BLOCK))
    want_b = _weight_scale_shape(E, N, K, recipe)
    if tuple(a_scale.shape) != want_a or tuple(b_scale.shape) != want_b:
        raise ValueError(f"{recipe} scales must be a_scale {want_a} and b_scale {want_b}, got "
                         f"{tuple(a_scale.shape)} and {tuple(b_scale.shape)}")


def fp8_grouped_mm_reference(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                             offs: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """Same contract as `fp8_grouped_mm`: the operands dequantised to fp32 and multiplied expert by expert (reads
    offs on the host: a reference, not a training path)."""
    _check_mm(a, a_scale, b, b_scale, offs, recipe)
    (M, K), (E, N, _) = a.shape, b.shape
    if recipe == "blockwise":
        a_scale, b_scale = _unblocks(a_scale, 1, K), _unblocks(_unblocks(b_scale, 1, N), 2, K)
    a32, b32 = a.float() * a_scale, b.float() * b_scale
    out = torch.zeros(M, N, dtype=torch.float32, device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = a32[start:end] @ b32[g].T
        start = end
    return out.to(torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------------
# Triton: quantisers


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


# ----------------------------------------------------------------------------------------------------------------
# Triton: the grouped GEMM


@triton.jit
def _tile_of(pid_m, offs_ptr, M, E, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """(group, first row, end row) of row tile `pid_m`, tiles numbered group by group. Group E is the tail
    [offs[E-1], M); a group past E means pid_m is past the last tile."""
    g = tl.arange(0, E_PAD)
    end = tl.load(offs_ptr + g, mask=g < E, other=M)
    start = tl.load(offs_ptr + g - 1, mask=(g > 0) & (g <= E), other=0)
    start = tl.where(g > E, M, start)  # padding groups: empty
    tiles = (end - start + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles, 0)
    group = tl.sum((ends <= pid_m).to(tl.int32), 0)
    mine = g == group
    row0 = tl.sum(tl.where(mine, start + (pid_m - ends + tiles) * BLOCK_M, 0), 0)
    return group, row0, tl.sum(tl.where(mine, end, 0), 0)


@triton.jit
def _banded(pid, m_tiles, n_tiles, BAND: tl.constexpr):
    """(row tile, column tile) of program `pid` on an m_tiles x n_tiles grid walked in bands of BAND row tiles: a
    band's row tiles for column tile 0, then for column tile 1, ...; the last band may be short."""
    band_programs = BAND * n_tiles
    first_m = pid // band_programs * BAND
    band_rows = tl.minimum(m_tiles - first_m, BAND)
    return first_m + pid % band_programs % band_rows, pid % band_programs // band_rows


def _set_block_shapes(nargs: dict) -> None:
    """Autotune pre-hook: the TMA descriptors (blockwise) load the tiles of the config being run."""
    if nargs["a_desc"] is not None:
        nargs["a_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
        nargs["b_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]


# (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_K stays 128, the blockwise scale block. Tensorwise tunes over its
# own tiles (with split accumulation too: offered blockwise's as well, the autotuner chose none of them at the bench
# shapes); blockwise over the 4-warp 128x64 / 64x128 tiles added for it (more programs per SM to overlap its scaling)
# and those of the shared ones at most one 128-wide scale block wide.
_TENSORWISE_TILES = [(128, 128, 8, 4), (128, 256, 8, 3), (128, 128, 4, 4), (64, 128, 4, 4), (64, 256, 8, 4)]
_BLOCKWISE_TILES = [(128, 64, 4, 3), (128, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 2)]
# Each tile runs in bands of 8 row tiles (a weight read once per band: 1.23x tensorwise, 1.28x blockwise at Mixtral's
# 58 MB expert weights) or of 1 (row tile by row tile: 4% faster for blockwise at Qwen3's gate/up, whose 3 MB weights
# stay in L2 in either order). bench/RESULTS.md has the figures.
_BANDS = (8, 1)
_MM_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": 128, "BAND": band}, num_warps=w,
                             num_stages=s, pre_hook=_set_block_shapes)
               for m, n, w, s in _TENSORWISE_TILES + _BLOCKWISE_TILES for band in _BANDS]


def _tile(c: triton.Config) -> tuple[int, int, int, int]:
    return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages


def _prune_configs(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Blockwise applies one weight scale per tile and K step, so its tiles are at most one scale block wide."""
    if not {**named_args, **kwargs}["BLOCKWISE"]:  # constexprs passed by keyword arrive in kwargs
        return [c for c in configs if _tile(c) in _TENSORWISE_TILES]
    return [c for c in configs if c.kwargs["BLOCK_N"] <= SCALE_BLOCK]


@triton.autotune(configs=autotune_configs(_MM_CONFIGS), key=["N", "K", "E", "BLOCKWISE", "FAST_ACCUM"],
                 prune_configs_by={"early_config_prune": _prune_configs})
@triton.jit
def _fp8_grouped_mm_kernel(a_ptr, a_desc, b_ptr, b_desc, a_scale_ptr, b_scale_ptr, offs_ptr, out_ptr, M, N,
                           K: tl.constexpr, E, stride_am, stride_be, stride_bn, stride_om,
                           stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
                           E_PAD: tl.constexpr, BLOCKWISE: tl.constexpr, FAST_ACCUM: tl.constexpr,
                           SCALE_BLOCK: tl.constexpr, BAND: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Blockwise loads its tiles through TMA descriptors: a_desc of a [M, K], b_desc of b viewed [E * N, K] (a tile's
    rows past its group's end and columns past N load the next group's rows or zeros, and are never stored).
    Tensorwise loads them through masked pointers (a_desc and b_desc are None): TMA was no faster there (within the
    bench's spread between calls), while blockwise gained most at the down and Mixtral shapes (bench/RESULTS.md).
    Programs are ordered in bands of BAND row tiles: consecutive programs take the band's row tiles for one column
    tile, then the next column tile. The programs in flight then share their weight tiles across the band and their
    activation rows across the column tiles in L2. With BAND=1 (row tile by row tile) a whole expert's weight is read
    again for every row tile: 58 MB at Mixtral's 14336x4096, more than L2 holds."""
    tl.static_assert(not BLOCKWISE or (BLOCK_K == SCALE_BLOCK and SCALE_BLOCK % BLOCK_N == 0))
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _banded(tl.program_id(0), tl.num_programs(0) // n_tiles, n_tiles, BAND)  # the grid's row tiles
    group, row0, row_end = _tile_of(pid_m, offs_ptr, M, E, E_PAD, BLOCK_M)
    if group > E:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < row_end, cols < N
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    out_mask = row_ok[:, None] & col_ok[None, :]
    if group == E:  # the tail past the last group: zeros
        tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty), mask=out_mask)
        return
    k_steps: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K  # K is constexpr: a static trip count
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if BLOCKWISE:
        # Each K step's product is scaled before it is added, so the scales are loaded one step ahead: their
        # latency hides behind the step's MMA instead of following it. The tile's columns lie in one weight block.
        sa_ptrs = a_scale_ptr + rows * stride_asm
        sb_ptr = b_scale_ptr + group * stride_bse + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_bsn
        sa_next = tl.load(sa_ptrs, mask=row_ok, other=0.0)
        sb_next = tl.load(sb_ptr)
        b_row = group * N + pid_n * BLOCK_N
        for kb in range(0, k_steps):
            s = sa_next * sb_next
            more = kb + 1 < k_steps
            sa_next = tl.load(sa_ptrs + (kb + 1) * stride_ask, mask=row_ok & more, other=0.0)
            sb_next = tl.load(sb_ptr + (kb + 1) * stride_bsk, mask=more, other=0.0)
            a = a_desc.load([row0, kb * BLOCK_K])
            b = b_desc.load([b_row, kb * BLOCK_K])
            acc += tl.dot(a, b.T) * s[:, None]
    else:
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :]
        b_ptrs = b_ptr + group.to(tl.int64) * stride_be + cols[None, :].to(tl.int64) * stride_bn + ks[:, None]
        for kb in range(0, k_steps):
            k_ok = ks < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if FAST_ACCUM:
                acc = tl.dot(a, b, acc)
            else:  # the dot's products leave the tensor cores' accumulator at its end: every BLOCK_K products
                acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        sa = tl.load(a_scale_ptr + rows * stride_asm, mask=row_ok, other=0.0)
        acc = acc * (sa[:, None] * tl.load(b_scale_ptr + group * stride_bse))
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _tma_operand(x: torch.Tensor) -> torch.Tensor:
    """`x` with its last dim contiguous and its base and other strides 16-byte aligned, as a TMA descriptor needs."""
    if x.stride(-1) != 1 or any(st * x.element_size() % 16 for st in x.stride()[:-1]):
        x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def fp8_grouped_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                   offs: torch.Tensor, recipe: Recipe, fast_accum: bool = False) -> torch.Tensor:
    """bf16 [M, N]: rows of group g (offs[g-1]:offs[g], offs[-1] = 0) are a[rows] @ b[g].T with the scales of
    `recipe` applied (see the module docstring); rows from offs[E-1] on are zero. a [M, K] and b [E, N, K] in e4m3,
    K contiguous; a_scale [M, 1] / b_scale [E, 1, 1] (tensorwise) or [M, ceil(K/128)] / [E, ceil(N/128),
    ceil(K/128)] (blockwise), fp32, any strides. `fast_accum` (tensorwise; blockwise always adds each K step's product
    to fp32): accumulate the whole K in the tensor cores, which on Hopper is faster and less precise. Triton on CUDA,
    the reference (exact fp32 accumulation) on CPU."""
    _check_mm(a, a_scale, b, b_scale, offs, recipe)
    if not use_triton(a):
        return fp8_grouped_mm_reference(a, a_scale, b, b_scale, offs, recipe)
    blockwise = recipe == "blockwise"
    if blockwise:
        a, b = _tma_operand(a), _tma_operand(b.contiguous())  # b is read as one [E * N, K] matrix
    else:
        a = a if a.stride(1) == 1 else a.contiguous()
        b = b if b.stride(2) == 1 else b.contiguous()
    (M, K), (E, N, _) = a.shape, b.shape
    out = torch.empty(M, N, dtype=torch.bfloat16, device=a.device)
    if M == 0 or N == 0:
        return out
    a_desc = b_desc = None
    if blockwise:  # block shapes are placeholders: the autotuner's pre-hook sets them from the config it runs
        a_desc = TensorDescriptor.from_tensor(a, [SCALE_BLOCK, SCALE_BLOCK])
        b_desc = TensorDescriptor.from_tensor(b.view(E * N, K), [SCALE_BLOCK, SCALE_BLOCK])
    grid = lambda meta: ((triton.cdiv(M, meta["BLOCK_M"]) + E + 1) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _fp8_grouped_mm_kernel[grid](a, a_desc, b, b_desc, a_scale, b_scale, offs, out, M, N, K, E,
                                 a.stride(0), b.stride(0), b.stride(1), out.stride(0),
                                 a_scale.stride(0), a_scale.stride(1),
                                 b_scale.stride(0), b_scale.stride(1), b_scale.stride(2),
                                 E_PAD=next_power_of_2(E + 1), BLOCKWISE=blockwise,
                                 FAST_ACCUM=fast_accum and not blockwise, SCALE_BLOCK=SCALE_BLOCK)
    return out


# ----------------------------------------------------------------------------------------------------------------
# The experts' linear layer


def grouped_wgrad(x: torch.Tensor, grad_out: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """dW [E, K, N] with dW[g] = x[rows of g].T @ grad_out[rows of g], in bf16 (torch._grouped_mm on CUDA; a loop
    over experts on CPU, which may read offs on the host)."""
    if x.is_cuda:
        return torch._grouped_mm(x.to(torch.bfloat16).t(), grad_out.to(torch.bfloat16), offs=offs)
    out = x.new_zeros(offs.shape[0], x.shape[1], grad_out.shape[1], dtype=torch.promote_types(x.dtype, grad_out.dtype))
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[g] = x[start:end].T.to(out.dtype) @ grad_out[start:end].to(out.dtype)
        start = end
    return out


class _Fp8GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs, recipe, w_quantized):
        xq, x_scale = quantize_rows(x, recipe)
        wq, wq_t, w_scale = quantize_weight(w, recipe) if w_quantized is None else w_quantized
        # forward operand [E, N, K]: the blockwise scales [E, Kb, Nb] read transposed
        out = fp8_grouped_mm(xq, x_scale, wq_t, w_scale.transpose(1, 2), offs, recipe, fast_accum=True)
        # A copy of the weight, not an activation, for memory accounting (services/trainer/memory_report.py): made
        # here, it has no autograd history that would tell it apart.
        wq.is_weight_copy = True
        ctx.save_for_backward(x, wq, w_scale, offs)
        ctx.recipe, ctx.w_dtype = recipe, w.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, wq, w_scale, offs = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # dX = dY @ W^T: W [E, K, N] is already the [E, out, contracted] operand
            gq, g_scale = quantize_rows(grad_out, ctx.recipe)
            grad_x = fp8_grouped_mm(gq, g_scale, wq, w_scale, offs, ctx.recipe).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = grouped_wgrad(x, grad_out, offs).to(ctx.w_dtype)
        return grad_x, grad_w, None, None, None


def _check_quantized(w: torch.Tensor, w_quantized: tuple, recipe: Recipe) -> None:
    """`w_quantized` must be what `quantize_weight(w, recipe)` returns: shapes, dtypes and device."""
    E, K, N = w.shape
    want = [((E, K, N), FP8), ((E, N, K), FP8), (_weight_scale_shape(E, K, N, recipe), torch.float32)]
    got = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else (type(t).__name__,) for t in w_quantized]
    if len(w_quantized) != 3 or got != want or any(t.device != w.device for t in w_quantized):
        raise ValueError(f"fp8_grouped_linear: `w_quantized` must be quantize_weight(w, {recipe!r}) for w "
                         f"{tuple(w.shape)} on {w.device}, i.e. (q, q_t, scale) of {want}; got {got}")


def fp8_grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: Recipe,
                       w_quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [M, K] @ w[g] [K, N] for the rows of each group g, through FP8: bf16 [M, N], rows from offs[-1] on zero.
    x and w keep their dtypes (w is the master weight, bf16 or fp32); x is quantised on the device each call, w too
    unless `w_quantized` gives `quantize_weight(w, recipe)` made earlier (weights that have not changed since: several
    micro-batches of one optimizer step). The gradient still flows to w.
    Backward: dgrad in FP8 (grad_out quantised to e4m3 by the same recipe), wgrad in bf16 (module docstring)."""
    _check_recipe(recipe)
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"fp8_grouped_linear wants x [M, K] and w [E, K, N], got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if w_quantized is not None:
        _check_quantized(w, w_quantized, recipe)
    return _Fp8GroupedLinear.apply(x, w, offs, recipe, w_quantized)
