"""swiglu_prob: the Triton kernels (on CUDA, else in Triton's CPU interpreter) against the torch reference.

Tolerances: both compute in fp32 and round once to x's dtype, so the kernel is compared with the reference evaluated
in fp32 on the same values, within torch.testing's defaults for the output dtype (fp32: rtol 1.3e-6, atol 1e-5;
bf16: rtol 1.6e-2, atol 1e-5). grad_prob is a length-f fp32 dot product: rtol/atol 1e-5."""

import pytest
import torch
from kernels_interpreter import DEVICE, kernels_on_device  # noqa: F401  (first: before triton is imported)

from kernels.swiglu import swiglu_prob, swiglu_prob_reference


def test_reference_is_silu_of_gate_times_up_times_prob():
    x, prob = torch.randn(5, 8), torch.rand(5)
    gate, up = x[:, :4], x[:, 4:]
    want = gate * torch.sigmoid(gate) * up * prob[:, None]
    torch.testing.assert_close(swiglu_prob_reference(x, prob), want)


# N, f: one row; f not a power of two; f over the first config's 256-column block (several column chunks).
SHAPES = [(1, 4), (7, 5), (33, 48), (20, 300)]


@pytest.mark.parametrize("N,f", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_gradients_match_reference(N, f, dtype):
    x = (2 * torch.randn(N, 2 * f, device=DEVICE)).to(dtype)
    prob = torch.rand(N, device=DEVICE)
    grad_out = torch.randn(N, f, device=DEVICE).to(dtype)

    def run(fn, x_dtype):
        xx, pp = x.to(x_dtype).requires_grad_(), prob.clone().requires_grad_()
        out = fn(xx, pp)
        return (out, *torch.autograd.grad(out, (xx, pp), grad_out.to(x_dtype)))

    got, got_gx, got_gp = run(swiglu_prob, dtype)
    want, want_gx, want_gp = run(swiglu_prob_reference, torch.float32)
    assert got.dtype == got_gx.dtype == dtype and got_gp.dtype == torch.float32
    torch.testing.assert_close(got, want.to(dtype))
    torch.testing.assert_close(got_gx, want_gx.to(dtype))
    torch.testing.assert_close(got_gp, want_gp, rtol=1e-5, atol=1e-5)


def test_folding_the_prob_into_the_activation_equals_weighting_the_expert_output():
    # Why the fold is legal: the down projection is linear, so scaling its input row scales its output row.
    x, prob, w_down = torch.randn(9, 12, device=DEVICE), torch.rand(9, device=DEVICE), torch.randn(6, 5, device=DEVICE)
    folded = swiglu_prob(x, prob) @ w_down
    weighted_after = (swiglu_prob(x, torch.ones_like(prob)) @ w_down) * prob[:, None]
    torch.testing.assert_close(folded, weighted_after)


def test_the_kernel_runs_on_cuda_or_in_the_interpreter_and_plain_cpu_runs_the_reference(monkeypatch):
    x = torch.randn(3, 4, device=DEVICE, requires_grad=True)
    prob = torch.rand(3, device=DEVICE)
    assert type(swiglu_prob(x, prob).grad_fn).__name__ == "_SwigluProbFunctionBackward"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = swiglu_prob(x.detach().cpu().requires_grad_(), prob.cpu())
    assert type(cpu.grad_fn).__name__ != "_SwigluProbFunctionBackward"


def test_bad_shapes_name_the_problem():
    with pytest.raises(ValueError, match="gate half"):
        swiglu_prob(torch.randn(3, 5), torch.rand(3))
    with pytest.raises(ValueError, match="one probability per permuted row"):
        swiglu_prob(torch.randn(3, 4), torch.rand(4))
