"""SwiGLU with the router probability folded in: the expert activation of memory-efficient permutation.

    swiglu_prob(x [N, 2f], prob [N]) -> [N, f] = silu(x[:, :f]) * x[:, f:] * prob[:, None]

Weighting each permuted row here, before the down projection (linear, so the weight commutes with it), means the
combine step is a plain sum (`unpermute(..., probs=None)`) and no [T*k, h] buffer of weighted expert outputs is ever
materialised or saved for backward. Backward needs only x and prob (both already live), not the output.

Math in fp32, one rounding to x's dtype. With a = x[:, :f], b = x[:, f:], s = sigmoid(a), g = grad_out:
    grad_a = g * b * prob * s * (1 + a * (1 - s))     grad_b = g * silu(a) * prob
    grad_prob = sum_f g * silu(a) * b                 (a row reduction: one program owns whole rows)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import autotune, use_triton

_FWD_CONFIGS = [
    triton.Config({"BLOCK_N": 8, "BLOCK_F": 256}, num_warps=4),
    triton.Config({"BLOCK_N": 4, "BLOCK_F": 512}, num_warps=4),
    triton.Config({"BLOCK_N": 16, "BLOCK_F": 256}, num_warps=8),
    triton.Config({"BLOCK_N": 8, "BLOCK_F": 1024}, num_warps=8),
    triton.Config({"BLOCK_N": 2, "BLOCK_F": 1024}, num_warps=4),
]
_BWD_CONFIGS = [
    triton.Config({"BLOCK_N": 4, "BLOCK_F": 256}, num_warps=4),
    triton.Config({"BLOCK_N": 8, "BLOCK_F": 256}, num_warps=8),
    triton.Config({"BLOCK_N": 2, "BLOCK_F": 512}, num_warps=4),
    triton.Config({"BLOCK_N": 4, "BLOCK_F": 1024}, num_warps=8),
    triton.Config({"BLOCK_N": 1, "BLOCK_F": 1024}, num_warps=4),
]


def _check(x: torch.Tensor, prob: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] % 2 != 0:
        raise ValueError(f"swiglu_prob wants x [N, 2f] (gate half, then up half), got {tuple(x.shape)}")
    if prob.shape != (x.shape[0],):
        raise ValueError(f"swiglu_prob wants prob [N] = [{x.shape[0]}] (one probability per permuted row), "
                         f"got {tuple(prob.shape)}")


def swiglu_prob_reference(x: torch.Tensor, prob: torch.Tensor) -> torch.Tensor:
    """Same contract as `swiglu_prob`, in plain (differentiable) torch ops."""
    _check(x, prob)
    a, b = x.float().chunk(2, dim=1)
    return (torch.nn.functional.silu(a) * b * prob.float().unsqueeze(1)).to(x.dtype)


@autotune(_FWD_CONFIGS, key=["f"])
@triton.jit
def _swiglu_prob_fwd_kernel(x_ptr, prob_ptr, out_ptr, N, f: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < N)[:, None] & (cols < f)[None, :]
    x_row = x_ptr + rows[:, None].to(tl.int64) * (2 * f)
    a = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_row + f + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    p = tl.load(prob_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    out = a * tl.sigmoid(a) * b * p[:, None]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * f + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@autotune(_BWD_CONFIGS, key=["f"])
@triton.jit
def _swiglu_prob_bwd_kernel(x_ptr, prob_ptr, grad_out_ptr, grad_x_ptr, grad_prob_ptr, N, f: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    rows64 = rows[:, None].to(tl.int64)
    p = tl.load(prob_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    grad_p = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, f, BLOCK_F):  # f is constexpr: a static trip count
        cols = start + tl.arange(0, BLOCK_F)
        mask = rmask[:, None] & (cols < f)[None, :]
        a = tl.load(x_ptr + rows64 * (2 * f) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + rows64 * (2 * f) + f + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(grad_out_ptr + rows64 * f + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(a)
        silu = a * s
        grad_a = g * b * p[:, None] * s * (1.0 + a * (1.0 - s))
        grad_b = g * silu * p[:, None]
        grad_p += tl.sum(g * silu * b, axis=1)
        gx_row = grad_x_ptr + rows64 * (2 * f)
        tl.store(gx_row + cols[None, :], grad_a.to(grad_x_ptr.dtype.element_ty), mask=mask)
        tl.store(gx_row + f + cols[None, :], grad_b.to(grad_x_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_prob_ptr + rows, grad_p.to(grad_prob_ptr.dtype.element_ty), mask=rmask)


class _SwigluProbFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, prob):
        x, prob = x.contiguous(), prob.contiguous()
        N, f = x.shape[0], x.shape[1] // 2
        out = torch.empty((N, f), dtype=x.dtype, device=x.device)
        if N > 0 and f > 0:
            grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(f, meta["BLOCK_F"]))  # noqa: E731
            _swiglu_prob_fwd_kernel[grid](x, prob, out, N, f)
        ctx.save_for_backward(x, prob)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, prob = ctx.saved_tensors
        N, f = x.shape[0], x.shape[1] // 2
        grad_x = torch.empty_like(x)
        grad_prob = torch.zeros_like(prob)
        if N > 0 and f > 0:
            grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
            _swiglu_prob_bwd_kernel[grid](x, prob, grad_out.contiguous(), grad_x, grad_prob, N, f)
        return grad_x, grad_prob


def swiglu_prob(x: torch.Tensor, prob: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up * prob per row (see the module docstring). Triton on CUDA, the torch reference on CPU."""
    _check(x, prob)
    if not use_triton(x):
        return swiglu_prob_reference(x, prob)
    return _SwigluProbFunction.apply(x, prob)
