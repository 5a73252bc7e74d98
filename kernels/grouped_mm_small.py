"""A grouped GEMM for few rows per group: the routed experts' GEMMs at rollout decode.

    grouped_mm_small(a [M, K], b [E, K, N], offs [E] int32) -> [M, N]

Rows offs[g - 1] .. offs[g] - 1 of `a` (offs[-1] = 0 before the first) times b[g]; rows past offs[E - 1] are not
computed (their output rows are left unspecified, as the experts' callers expect). The same contract as
`torch._grouped_mm(a, b, offs=offs)` for a 2D `a` and a 3D `b`.

Why a kernel: a decode step of a rollout batch routes a few rows to each expert (256 sequences x top-8 over 128
experts: ~16), so the GEMMs only stream the experts' weights, and `torch._grouped_mm`'s tiles are sized for many rows.
Here a program per (column tile, expert) reads its slab of the expert's weight once (the expert's rows in one
BLOCK_M tile, or a loop over tiles) and skips experts without rows. The rollout takes it where the rows per expert are
few (`FEW_ROWS`, bench/bench_grouped_mm_small.py); training keeps `torch._grouped_mm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import autotune, use_triton

FEW_ROWS = 16  # mean rows per expert up to which the experts' no-grad GEMMs take this kernel (bench/RESULTS.md)
_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bn, bk, w, s in ((64, 128, 4, 4), (128, 128, 4, 4), (64, 64, 4, 5), (128, 64, 8, 4), (32, 128, 4, 4),
                                 (64, 256, 8, 3))]


def _check(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> None:
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[1]:
        raise ValueError(f"grouped_mm_small wants a [M, K] and b [E, K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    if offs.shape != (b.shape[0],) or offs.dtype != torch.int32:
        raise ValueError(f"grouped_mm_small wants offs: int32 [{b.shape[0]}] cumulative rows per group, got "
                         f"{offs.dtype} {tuple(offs.shape)}")


def grouped_mm_small_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Same contract as `grouped_mm_small`, group by group in torch ops (fp32 products, rounded to a's dtype once);
    the rows past the last group are zeros."""
    _check(a, b, offs)
    out = a.new_zeros(a.shape[0], b.shape[2])
    ends = offs.tolist()
    for g, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
        out[start:end] = (a[start:end].float() @ b[g].float()).to(a.dtype)
    return out


@autotune(_CONFIGS, key=["N", "K"])
@triton.jit
def _grouped_mm_small_kernel(a_ptr, b_ptr, offs_ptr, out_ptr, N, K: tl.constexpr, stride_am, stride_be, stride_bk,
                             stride_om, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    """Program (column tile, group): the group's rows, BLOCK_M at a time, times its [K, BLOCK_N] weight slab."""
    pid_n = tl.program_id(0)
    g = tl.program_id(1)
    start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    end = tl.load(offs_ptr + g)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    b_base = b_ptr + g.to(tl.int64) * stride_be + cols[None, :]
    row0 = start
    # `while`: Triton 3.6's interpreter takes no runtime loop bound; a group without rows reads nothing
    while row0 < end:
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :]
        b_ptrs = b_base + ks[:, None].to(tl.int64) * stride_bk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # K is constexpr: a static trip count
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if IEEE:  # fp32 operands: fp32 products, as the reference (not TF32)
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_bk
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])
        row0 += BLOCK_M


def grouped_mm_small(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a's rows times their groups' weights (module docstring). Triton on CUDA, the torch reference on CPU."""
    _check(a, b, offs)
    if not use_triton(a):
        return grouped_mm_small_reference(a, b, offs)
    if a.stride(1) != 1:
        a = a.contiguous()
    if b.stride(2) != 1:
        b = b.contiguous()
    M, K = a.shape
    E, _, N = b.shape
    out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    if M:
        grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), E)  # noqa: E731
        _grouped_mm_small_kernel[grid](a, b, offs, out, N, K, a.stride(0), b.stride(0), b.stride(1), out.stride(0),
                                       IEEE=a.dtype == torch.float32, BLOCK_M=32)
    return out
