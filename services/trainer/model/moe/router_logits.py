"""The router's fp32 logits computed on bf16 tensor cores.

The router scores in fp32 (small logit differences decide routing). An fp32 GEMM runs on the CUDA cores, not the tensor
cores: at Qwen3-30B-A3B's shape (16,384 tokens, h=2048, 128 experts) its three GEMMs and the fp32 copy of x took
~0.75 ms of the MoE layer's 8.5 (bench/RESULTS.md). Nearly the same result comes from bf16 tensor-core GEMMs:

- x in bf16 (a layer run in bf16: the rollout engine's model, the MoE layer bench) is exact bf16 numbers. The
  trainer's residual stream is fp32: it keeps the fp32 GEMM (splitting x too was estimated, not built, to cost about
  what that GEMM costs at 8,192 tokens).
- An fp32 number is, exactly, the sum of at most three bf16 numbers: hi = bf16(w), mid = bf16(w - hi),
  lo = bf16(w - hi - mid) (each difference is exact in fp32; each part takes the next 8+ bits of fp32's 24).
- A product of two bf16 numbers is exact in fp32, and the tensor cores accumulate in (nearly) fp32.

So `x @ [hi; mid; lo]^T`, one bf16 GEMM with fp32 output against the [3E, h] stacked parts, summed over the parts,
is x·wᵀ from exact products. Backward the same way: dW = Σ over dlogits' three parts of partᵀ·x; dx = dlogits·W,
rounded to bf16 anyway, keeps the products above 2⁻¹⁶ of the largest (hi·hi, hi·mid, mid·hi): one GEMM of
[dl_hi | dl_hi | dl_mid] against [W_hi; W_mid; W_hi]. A bf16 weight (the rollout engine's bf16 model) is its own one
part. What is not fp32 is the tensor cores' addition: on an H100 the logits came out up to ~3e-6 off relative to the
largest (the fp32 GEMM ~1e-6) and the weight gradient over 16,384 tokens 1e-5 (7.5e-7); a bf16 GEMM is ~1.5e-3 off
(bench/RESULTS.md). The layer in bf16 at Qwen3-30B-A3B's shape: 8.5 -> 7.9 ms.

`router_logits` takes this path for bf16 x on CUDA and computes `F.linear(x.float(), weight.float())` otherwise; on
CPU the same parts are multiplied in fp32 (exact products, fp32 additions), which is how the tests check the
splitting against the fp32 reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[T, h] x, [E, h] weight -> [T, E] fp32 logits, with gradients to both in their own dtypes."""
    with torch.autocast(x.device.type, enabled=False):  # autocast would run these GEMMs in bf16 with bf16 outputs
        if x.dtype == torch.bfloat16 and x.is_cuda:
            return SplitBf16Logits.apply(x, weight)
        return F.linear(x.float(), weight.float())


def split_bf16(t: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """bf16 tensors whose fp32 sum is `t` (fp32: exactly, with three parts), largest first."""
    out, rest = [], t.float()
    for _ in range(parts):
        part = rest.to(torch.bfloat16)
        out.append(part)
        rest = rest - part.float()
    return out


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for bf16 operands, accumulated and returned in fp32 (the tensor cores on CUDA; fp32 elsewhere, where
    torch has no mixed-dtype mm: the same exact products)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def _parts_of(weight: torch.Tensor) -> int:
    return 1 if weight.dtype == torch.bfloat16 else 3


class SplitBf16Logits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        parts = split_bf16(weight, _parts_of(weight))
        stacked = torch.cat(parts) if len(parts) > 1 else parts[0]  # [parts·E, h]
        logits = mm_fp32(x, stacked.t()).view(x.shape[0], len(parts), -1).sum(1)
        ctx.save_for_backward(x, weight)
        return logits

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        E = weight.shape[0]
        g = split_bf16(grad, 3)  # [T, E] each
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            w = split_bf16(weight, min(2, _parts_of(weight)))
            if len(w) == 1:  # bf16 weight: (g_hi + g_mid)·w
                lhs, rhs = torch.cat(g[:2], dim=1), torch.cat([w[0], w[0]])
            else:  # the products above 2^-16 of the largest: g_hi·w_hi + g_hi·w_mid + g_mid·w_hi
                lhs, rhs = torch.cat([g[0], g[0], g[1]], dim=1), torch.cat([w[0], w[1], w[0]])
            grad_x = torch.mm(lhs, rhs) if lhs.is_cuda else torch.mm(lhs.float(), rhs.float()).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = mm_fp32(torch.cat(g, dim=1).t(), x).view(3, E, -1).sum(0).to(weight.dtype)
        return grad_x, grad_w
