"""unpermute (combine): the Triton kernel (on CUDA, else in Triton's CPU interpreter) against the torch reference.

Tolerances: the kernel accumulates the k weighted copies in fp32 and rounds once, so it is compared with the
reference evaluated in fp32 on the same values, within fp32 (rtol 1.3e-6, atol 1e-5) or bf16 (rtol 1.6e-2,
atol 1e-5) rounding of the result (torch.testing's defaults for the output dtype)."""

import pytest
import torch
from kernels_interpreter import DEVICE, kernels_on_device  # noqa: F401  (first: before triton is imported)

from kernels.permute import permute
from kernels.unpermute import unpermute, unpermute_reference


def routing(T: int, k: int, E: int, seed: int, drop_every: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if drop_every:
        indices[::drop_every, 0] = -1
    return indices.to(DEVICE)


def test_reference_is_the_probability_weighted_sum_of_each_tokens_copies():
    T, k, E, h = 6, 2, 4, 3
    indices = routing(T, k, E, seed=0, drop_every=3).cpu()
    row_id_map = permute(torch.zeros(T, h), indices, E).row_id_map
    expert_out, probs = torch.randn(T * k, h), torch.rand(T, k)
    out = unpermute_reference(expert_out, row_id_map, probs)
    for t in range(T):
        want = sum(probs[t, j] * expert_out[row_id_map[t, j]] for j in range(k) if indices[t, j] >= 0)
        torch.testing.assert_close(out[t], want + torch.zeros(h))


# T, k, E, h: one token, k=1, E not a power of two, h not a power of two / over one 1024-column block.
SHAPES = [(1, 1, 1, 4), (1, 3, 5, 7), (17, 1, 3, 16), (29, 4, 6, 33), (12, 2, 9, 1100)]


@pytest.mark.parametrize("T,k,E,h", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
def test_forward_and_gradients_match_reference(T, k, E, h, dtype, weighted):
    indices = routing(T, k, E, seed=T + 10 * k + 100 * E, drop_every=4 if T > 4 else 0)
    row_id_map = permute(torch.zeros(T, h, device=DEVICE), indices, E).row_id_map
    expert_out = torch.randn(T * k, h, device=DEVICE).to(dtype)
    probs = torch.rand(T, k, device=DEVICE) if weighted else None
    grad_out = torch.randn(T, h, device=DEVICE).to(dtype)

    def run(fn, x_dtype):
        x = expert_out.to(x_dtype).requires_grad_()
        p = probs.clone().requires_grad_() if weighted else None
        out = fn(x, row_id_map, p)
        grads = torch.autograd.grad(out, (x, p) if weighted else (x,), grad_out.to(x_dtype))
        return out, grads

    got, got_grads = run(unpermute, dtype)
    want, want_grads = run(unpermute_reference, torch.float32)
    assert got.dtype == dtype and got.shape == (T, h)
    torch.testing.assert_close(got, want.to(dtype))
    torch.testing.assert_close(got_grads[0], want_grads[0].to(dtype))  # prob * grad_out, rounded once
    if weighted:
        # grad_probs is an fp32 dot product over h of (rounded) values: relative error grows like sqrt(h) * eps.
        torch.testing.assert_close(got_grads[1], want_grads[1], rtol=1e-5, atol=1e-5)


def test_dropped_copies_contribute_nothing_and_get_zero_gradient():
    T, k, E, h = 8, 2, 4, 5
    indices = routing(T, k, E, seed=2)
    indices[:, 1] = -1
    row_id_map = permute(torch.zeros(T, h, device=DEVICE), indices, E).row_id_map
    expert_out = torch.randn(T * k, h, device=DEVICE, requires_grad=True)
    probs = torch.rand(T, k, device=DEVICE, requires_grad=True)
    out = unpermute(expert_out, row_id_map, probs)
    torch.testing.assert_close(out, probs[:, :1] * expert_out[row_id_map[:, 0].long()])
    grad_x, grad_p = torch.autograd.grad(out.sum(), (expert_out, probs))
    assert torch.all(grad_x[T:] == 0) and torch.all(grad_p[:, 1] == 0)


def test_the_kernel_runs_on_cuda_or_in_the_interpreter_and_plain_cpu_runs_the_reference(monkeypatch):
    row_id_map = permute(torch.zeros(3, 2, device=DEVICE), routing(3, 2, 3, seed=1), 3).row_id_map
    expert_out = torch.randn(6, 2, device=DEVICE, requires_grad=True)
    assert type(unpermute(expert_out, row_id_map).grad_fn).__name__ == "_UnpermuteFunctionBackward"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = unpermute(expert_out.detach().cpu().requires_grad_(), row_id_map.cpu())
    assert type(cpu.grad_fn).__name__ != "_UnpermuteFunctionBackward"


def test_a_buffer_that_does_not_match_the_map_is_rejected():
    with pytest.raises(ValueError, match="full permuted buffer"):
        unpermute(torch.randn(5, 2), torch.zeros(3, 2, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capacity_layout_combine_matches_reference_and_padding_rows_get_zero_gradient(dtype):
    """`permute(..., capacity=c)`'s E*c rows (kept copies, then padding no slot owns): the combine reads only the
    kept rows, and its backward leaves every padding row's gradient at zero (the experts' weight gradients sum over
    their padding rows too)."""
    T, k, E, h, c = 29, 3, 6, 33, 17
    indices = routing(T, k, E, seed=4, drop_every=3)
    perm = permute(torch.zeros(T, h, device=DEVICE), indices, E, capacity=c)
    expert_out = torch.randn(E * c, h, device=DEVICE).to(dtype)
    probs, grad_out = torch.rand(T, k, device=DEVICE), torch.randn(T, h, device=DEVICE).to(dtype)

    def run(fn, x_dtype):
        x, p = expert_out.to(x_dtype).requires_grad_(), probs.clone().requires_grad_()
        out = fn(x, perm.row_id_map, p, padded=True)
        return out, torch.autograd.grad(out, (x, p), grad_out.to(x_dtype))

    (got, (gx, gp)), (want, (wx, wp)) = run(unpermute, dtype), run(unpermute_reference, torch.float32)
    torch.testing.assert_close(got, want.to(dtype))
    torch.testing.assert_close(gx, wx.to(dtype))
    torch.testing.assert_close(gp, wp, rtol=1e-5, atol=1e-5)
    owned = torch.zeros(E * c, dtype=torch.bool, device=DEVICE)
    rows = perm.row_id_map.reshape(-1)
    owned[rows[rows >= 0].long()] = True
    assert (~owned).any() and not gx[~owned].any(), "a padding row got a gradient"
