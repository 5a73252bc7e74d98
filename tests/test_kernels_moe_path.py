"""The kernels composed into an MoE FFN (route -> permute -> expert SwiGLU with the prob folded in -> unpermute)
compute, and differentiate, the same thing as the definition: out[t] = sum_j w[t, j] * FFN_{e(t, j)}(x[t]).
Tolerances: fp32 end to end, rtol 1e-4 / atol 1e-5 (several matmuls and reductions in a different order)."""

import torch
from kernels_interpreter import DEVICE, kernels_on_device  # noqa: F401  (first: before triton is imported)

from kernels.permute import permute
from kernels.router import router
from kernels.swiglu import swiglu_prob
from kernels.unpermute import unpermute


def moe_with_kernels(x, w_router, w_up, w_down, k):
    E = w_up.shape[0]
    routing = router(x @ w_router, k, "softmax", normalise=True)
    perm = permute(x, routing.indices, E, routing.weights)
    offsets = perm.offsets.tolist()  # the test loops over experts on the host; the trainer uses a grouped GEMM
    hidden = []
    for e in range(E):
        rows = slice(offsets[e], offsets[e + 1])
        hidden.append(swiglu_prob(perm.permuted[rows] @ w_up[e], perm.permuted_probs[rows]) @ w_down[e])
    return unpermute(torch.cat(hidden), perm.row_id_map)  # probs already folded in: a plain sum


def moe_by_definition(x, w_router, w_up, w_down, k):
    probs = torch.softmax(x @ w_router, -1)
    weights, experts = torch.topk(probs, k)
    weights = weights / weights.sum(-1, keepdim=True)
    f = w_down.shape[1]
    rows = []
    for t in range(x.shape[0]):
        out = 0
        for j in range(k):
            h = x[t] @ w_up[experts[t, j]]
            out = out + weights[t, j] * ((torch.nn.functional.silu(h[:f]) * h[f:]) @ w_down[experts[t, j]])
        rows.append(out)
    return torch.stack(rows)


def test_kernel_moe_equals_the_definition_forward_and_backward():
    T, h, f, E, k = 19, 8, 6, 5, 2
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(*shape, generator=g).to(DEVICE) * scale for shape, scale in
              [((T, h), 1.0), ((h, E), 0.5), ((E, h, 2 * f), 0.3), ((E, f, h), 0.3)]]

    def run(fn):
        leaves = [p.clone().requires_grad_() for p in params]
        out = fn(*leaves, k)
        return out, torch.autograd.grad(out.square().sum(), leaves)

    got, got_grads = run(moe_with_kernels)
    want, want_grads = run(moe_by_definition)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
