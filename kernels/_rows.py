"""Row movement between token order [T, h] and expert order [T*k, h], driven by a row_id_map [T, k].

`row_id_map[t, j] = r >= 0` means token t's j-th routed copy lives in expert-order row r. A negative entry marks a
dropped copy (capacity overflow); it holds `~r` (= -r-1), the row reserved for it in the tail after every routed row.
Every one of the T*k rows is therefore the target of exactly one slot, so scattering writes each row exactly once
(a dropped slot writes zeros) and the output needs no memset.

Pad-to-capacity buffers (`scatter_rows(..., rows=E*capacity)`) are the exception: every expert owns `capacity` rows,
its kept copies first, and rows no slot targets are padding. There the output starts as zeros and a negative entry
targets no row (a dropped copy has no place in a full expert's rows).

The row width h is a compile-time constant: a model has one or two of them, and a constant trip count keeps the
column loop a plain Python loop in Triton 3.6's interpreter (a runtime bound there fails under numpy >= 2.4).

Two kernels, each one program per token so every load and store is a contiguous row segment:
- scatter (token -> its k rows): permute's forward, and unpermute's backward, where it also takes the per-slot dot
  products that are the gradient of the combine weights;
- gather (k rows -> token, optionally weighted): unpermute's forward, and permute's backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import autotune, next_power_of_2

_ROW_CONFIGS = [
    triton.Config({"BLOCK_H": 1024}, num_warps=4),
    triton.Config({"BLOCK_H": 512}, num_warps=4),
    triton.Config({"BLOCK_H": 2048}, num_warps=8),
    triton.Config({"BLOCK_H": 1024}, num_warps=8),
    triton.Config({"BLOCK_H": 256}, num_warps=2),
]


@autotune(_ROW_CONFIGS, key=["h", "K"])
@triton.jit
def _scatter_rows_kernel(src_ptr, row_id_map_ptr, weights_ptr, dot_src_ptr, out_ptr, dots_ptr, h: tl.constexpr,
                         K: tl.constexpr, K_PAD: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_DOT: tl.constexpr,
                         DROPPED_WRITE: tl.constexpr, BLOCK_H: tl.constexpr):
    # out[row(t, j)] = weights[t, j] * src[t];  dots[t, j] = <src[t], dot_src[row(t, j)]>  (0 for a dropped slot)
    # DROPPED_WRITE: a dropped slot writes zeros to its tail row ~row; else (padded buffers) it writes nothing.
    t = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, K_PAD)
    dots = tl.zeros([K_PAD], dtype=tl.float32)
    for start in range(0, h, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        cmask = cols < h
        x = tl.load(src_ptr + t * h + cols, mask=cmask, other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            row = tl.load(row_id_map_ptr + t * K + j).to(tl.int64)
            routed = row >= 0
            target = tl.where(routed, row, -row - 1)
            value = x
            if HAS_WEIGHTS:
                value = value * tl.load(weights_ptr + t * K + j).to(tl.float32)
            value = tl.where(routed, value, 0.0)
            tl.store(out_ptr + target * h + cols, value.to(out_ptr.dtype.element_ty),
                     mask=cmask & (routed | DROPPED_WRITE))
            if HAS_DOT:
                y = tl.load(dot_src_ptr + row * h + cols, mask=cmask & routed, other=0.0).to(tl.float32)
                dots = tl.where(slots == j, dots + tl.sum(x * y, axis=0), dots)
    if HAS_DOT:
        tl.store(dots_ptr + t * K + slots, dots.to(dots_ptr.dtype.element_ty), mask=slots < K)


@autotune(_ROW_CONFIGS, key=["h", "K"])
@triton.jit
def _gather_rows_kernel(src_ptr, row_id_map_ptr, weights_ptr, out_ptr, h: tl.constexpr,
                        K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_H: tl.constexpr):
    # out[t] = sum_j weights[t, j] * src[row(t, j)] over routed slots, accumulated in fp32.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < h
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(row_id_map_ptr + t * K + j).to(tl.int64)
        x = tl.load(src_ptr + row * h + cols, mask=cmask & (row >= 0), other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            x = x * tl.load(weights_ptr + t * K + j).to(tl.float32)
        acc += x
    tl.store(out_ptr + t * h + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def scatter_rows(src: torch.Tensor, row_id_map: torch.Tensor, weights: torch.Tensor | None = None,
                 dot_src: torch.Tensor | None = None, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token order -> expert order: returns (out [T*k, h], dots [T, k] fp32 or None). Contiguous inputs only.
    `rows`: a pad-to-capacity buffer of that many rows instead (zeros where no slot writes; dropped slots write
    nothing)."""
    T, h = src.shape
    K = row_id_map.shape[1]
    padded = rows is not None
    out = (torch.zeros if padded else torch.empty)((rows if padded else T * K, h), dtype=src.dtype, device=src.device)
    dots = torch.empty((T, K), dtype=torch.float32, device=src.device) if dot_src is not None else None
    if T == 0 or h == 0:
        if dots is not None:
            dots.zero_()
        return out.zero_(), dots
    _scatter_rows_kernel[(T,)](
        src, row_id_map, weights if weights is not None else src, dot_src if dot_src is not None else src,
        out, dots if dots is not None else out, h,
        K=K, K_PAD=next_power_of_2(K), HAS_WEIGHTS=weights is not None, HAS_DOT=dot_src is not None,
        DROPPED_WRITE=not padded)
    return out, dots


def gather_rows(src: torch.Tensor, row_id_map: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Expert order -> token order: out [T, h] = sum over each token's routed rows, optionally weighted."""
    T, K = row_id_map.shape
    h = src.shape[1]
    out = torch.empty((T, h), dtype=src.dtype, device=src.device)
    if T == 0 or h == 0:
        return out
    grid = lambda meta: (T, triton.cdiv(h, meta["BLOCK_H"]))  # noqa: E731
    _gather_rows_kernel[grid](src, row_id_map, weights if weights is not None else src, out, h,
                              K=K, HAS_WEIGHTS=weights is not None)
    return out
