"""FP8 (e4m3) grouped GEMM for the routed experts, and an autograd linear on top (quantisers: kernels/fp8_quantize.py).

    fp8_grouped_mm(a [M, K] e4m3, a_scale, b [E, N, K] e4m3, b_scale, offs [E] int32, recipe, fast_accum=False)
        -> [M, N] bf16
        out[offs[g-1]:offs[g]] = (a[offs[g-1]:offs[g]] @ b[g].T) * scales;  rows from offs[E-1] on: zero
    fp8_grouped_linear(x [M, K], w [E, K, N], offs, recipe, w_quantized=None) -> [M, N] bf16
        (autograd; quantises on the device, the weight unless `w_quantized` holds quantize_weight(w, recipe))

Recipes (the fp32 scales come from kernels/fp8_quantize.py, which says how they are made):
- "tensorwise": one scale per activation row (a_scale [M, 1]) and one per expert weight (b_scale [E, 1, 1]); the
  scales are applied once, in the epilogue. With `fast_accum` the tensor cores accumulate the whole K in their own
  reduced-precision fp8 accumulator on Hopper (Triton's default for fp8 there); without it (the default, as
  torch._scaled_mm's `use_fast_accum=False`) each 128-deep K step's product is added to an fp32 accumulator, as
  blockwise does. The linear below uses fast accumulation in forward and split accumulation in dgrad, as Transformer
  Engine's FP8 recipes do (its `fp8_gemm_fprop` / `fp8_gemm_dgrad`).
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

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels._triton import autotune, next_power_of_2, use_triton
from kernels.fp8_quantize import (FP8, SCALE_BLOCK, Recipe, _check_recipe, _unblocks, _weight_scale_shape,
                                  quantize_rows, quantize_weight)


# ----------------------------------------------------------------------------------------------------------------
# Checks and the torch reference


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
    (M, K), (_, N, _) = a.shape, b.shape
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


@autotune(_MM_CONFIGS, key=["N", "K", "E", "BLOCKWISE", "FAST_ACCUM"],
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
