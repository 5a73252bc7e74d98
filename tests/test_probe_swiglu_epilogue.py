"""bench/probe_swiglu_epilogue.py's two fused kernels compute what the MoE layer's unfused pair computes (the probe's
timings in bench/RESULTS.md are only worth something if they are), on CUDA or in Triton's CPU interpreter.

Shapes: three experts, one of them empty, row counts that leave partial row tiles. On CPU the operands are fp16: the
interpreter's TMA-descriptor loads return wrong values for bf16 (checked against a plain matmul), not for fp16; the
kernels are dtype-generic. Tolerance: the GEMM output is rounded to the operands' dtype in both paths, so they differ
by the summation order only: rtol/atol 2e-3 (fp16) / 2e-2 (bf16) on values of order 1; dprob (fp32) relative 1e-3."""

import torch
from kernels_interpreter import DEVICE, ON_CUDA, import_kernels, kernels_on_device  # noqa: F401  (first)

(probe,) = import_kernels("bench.probe_swiglu_epilogue")
gate_up_swiglu, down_dgrad_swiglu = probe.gate_up_swiglu, probe.down_dgrad_swiglu

H = F = 128  # the first (interpreter) config's tiles: 128 rows x 128 columns x 64
COUNTS = [130, 0, 190]
DTYPE = torch.bfloat16 if ON_CUDA else torch.float16
TOL = 2e-2 if ON_CUDA else 2e-3


def _operands():
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor(COUNTS)
    E, M = len(COUNTS), int(counts.sum())
    group = torch.repeat_interleave(torch.arange(E), counts)
    x = torch.randn(M, H, generator=g)
    w13 = torch.randn(E, H, 2 * F, generator=g) / H ** 0.5
    w2 = torch.randn(E, F, H, generator=g) / F ** 0.5
    prob = torch.rand(M, generator=g)
    dy = torch.randn(M, H, generator=g)
    to = lambda t: t.to(DEVICE, DTYPE)  # noqa: E731
    return group, counts.cumsum(0).to(DEVICE, torch.int32), to(x), to(w13), to(w2), prob.to(DEVICE), to(dy)


def test_gate_up_gemm_with_swiglu_epilogue_matches_the_gemm_then_swiglu():
    group, offs, x, w13, _, prob, _ = _operands()
    h_want = torch.einsum("mk,mkn->mn", x.float(), w13.float()[group.to(DEVICE)]).to(DTYPE)
    gate, up = h_want.float().chunk(2, dim=1)
    act_want = (torch.nn.functional.silu(gate) * up * prob[:, None]).to(DTYPE)
    h, act = gate_up_swiglu(x, w13, offs, prob)
    torch.testing.assert_close(h, h_want, rtol=TOL, atol=TOL)
    torch.testing.assert_close(act, act_want, rtol=TOL, atol=TOL)


def test_dgrad_with_swiglu_backward_epilogue_matches_autograd_of_swiglu():
    group, offs, x, w13, w2, prob, dy = _operands()
    h = torch.einsum("mk,mkn->mn", x.float(), w13.float()[group.to(DEVICE)]).to(DTYPE)
    dact = torch.einsum("mk,mnk->mn", dy.float(), w2.float()[group.to(DEVICE)]).to(DTYPE)
    hh, pp = h.float().requires_grad_(), prob.clone().requires_grad_()
    gate, up = hh.chunk(2, dim=1)
    (torch.nn.functional.silu(gate) * up * pp[:, None]).backward(dact.float())
    dh, dprob = down_dgrad_swiglu(dy, w2, offs, h, prob)
    torch.testing.assert_close(dh, hh.grad.to(DTYPE), rtol=TOL, atol=TOL)
    torch.testing.assert_close(dprob, pp.grad, rtol=1e-3, atol=1e-3 * pp.grad.abs().max().item())
