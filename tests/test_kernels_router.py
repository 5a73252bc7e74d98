"""router: the Triton kernel (on CUDA, else in Triton's CPU interpreter) against the torch reference, and the reference
against the routing semantics. Both compute in fp32 whatever the logits' dtype: chosen experts and counts must match
exactly (random logits have no near-ties), weights and mean_probs within rtol 1e-5 / atol 1e-6, gradients within
rtol 1e-5 / atol 1e-6 (fp32 logits; bf16 logits' gradients are compared after rounding to bf16)."""

import pytest
import torch
from kernels_interpreter import DEVICE, kernels_on_device  # noqa: F401  (first: before triton is imported)

from kernels.router import Routing, router, router_reference


def assert_same(got: Routing, want: Routing) -> None:
    assert torch.equal(got.indices, want.indices)
    assert torch.equal(got.tokens_per_expert, want.tokens_per_expert)
    torch.testing.assert_close(got.weights, want.weights, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.mean_probs, want.mean_probs, rtol=1e-5, atol=1e-6)


def test_reference_follows_the_routing_semantics():
    T, E, k = 16, 8, 2
    logits, bias = torch.randn(T, E), 0.1 * torch.randn(E)
    out = router_reference(logits, k, "softmax", bias, normalise=True, scaling_factor=2.0)
    probs = torch.softmax(logits, -1)
    chosen = torch.topk(probs + bias, k).indices
    assert torch.equal(out.indices, chosen)
    picked = probs.gather(1, chosen)
    torch.testing.assert_close(out.weights, 2.0 * picked / picked.sum(-1, keepdim=True))
    assert out.tokens_per_expert.tolist() == torch.bincount(chosen.flatten(), minlength=E).tolist()
    torch.testing.assert_close(out.mean_probs, probs.mean(0))

    sig = router_reference(logits, k, "sigmoid", None, normalise=False, scaling_factor=1.0)
    scores = torch.sigmoid(logits)
    torch.testing.assert_close(sig.weights, scores.gather(1, torch.topk(scores, k).indices))
    torch.testing.assert_close(sig.mean_probs, (scores / scores.sum(-1, keepdim=True)).mean(0))


def test_expert_bias_changes_the_choice_but_not_the_weight():
    T, E = 10, 6
    logits = torch.randn(T, E, device=DEVICE)
    bias = torch.zeros(E, device=DEVICE)
    bias[4] = 10.0  # far above any score: expert 4 is everyone's first choice
    out = router(logits, 1, "softmax", bias)
    assert torch.all(out.indices[:, 0] == 4)
    torch.testing.assert_close(out.weights[:, 0], torch.softmax(logits, -1)[:, 4])


# T, E, k: one token; k=1; k=E; E not a power of two; Qwen3-like E=128 over several programs; E=256 (16-row blocks).
SHAPES = [(1, 4, 2), (5, 3, 3), (37, 10, 1), (40, 60, 4), (70, 128, 8), (20, 256, 8)]


@pytest.mark.parametrize("T,E,k", SHAPES)
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_kernel_matches_reference(T, E, k, score_function):
    g = torch.Generator().manual_seed(T * E + k)
    logits = torch.randn(T, E, generator=g).to(DEVICE)
    bias = (0.05 * torch.randn(E, generator=g)).to(DEVICE)
    for expert_bias, normalise, scale in [(None, False, 1.0), (bias, True, 2.5)]:
        args = (k, score_function, expert_bias, normalise, scale)
        assert_same(router(logits, *args), router_reference(logits, *args))


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_reference(score_function, dtype):
    T, E, k = 23, 12, 3
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(T, E, generator=g).to(DEVICE, dtype)
    bias = (0.05 * torch.randn(E, generator=g)).to(DEVICE)
    grad_w, grad_mean = torch.randn(T, k, generator=g).to(DEVICE), torch.randn(E, generator=g).to(DEVICE)

    def grads(fn):
        x = logits.clone().requires_grad_()
        out = fn(x, k, score_function, bias, True, 1.5)
        loss = (out.weights * grad_w).sum() + (out.mean_probs * grad_mean).sum()
        return torch.autograd.grad(loss, x)[0]

    got, want = grads(router), grads(router_reference)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)



@pytest.mark.parametrize("T,E,k", SHAPES)
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalise,scale", [(False, 1.0), (True, 2.5)])
@pytest.mark.parametrize("through", ["weights", "mean_probs", "both"])
def test_fused_backward_matches_autograd_through_the_reference(T, E, k, score_function, normalise, scale, through):
    """The backward kernel against torch autograd over the reference, for every shape, each output's gradient alone
    and both together (the aux loss reaches the router only through mean_probs, the experts only through weights)."""
    g = torch.Generator().manual_seed(T + E + k)
    logits = (2 * torch.randn(T, E, generator=g)).to(DEVICE)
    grad_w, grad_mean = torch.randn(T, k, generator=g).to(DEVICE), torch.randn(E, generator=g).to(DEVICE)

    def grads(fn):
        x = logits.clone().requires_grad_()
        out = fn(x, k, score_function, None, normalise, scale)
        loss = (out.weights * grad_w).sum() if through != "mean_probs" else 0.0
        if through != "weights":
            loss = loss + (out.mean_probs * grad_mean).sum()
        return torch.autograd.grad(loss, x)[0]

    torch.testing.assert_close(grads(router), grads(router_reference), rtol=1e-5, atol=1e-6)

def test_bf16_logits_route_like_their_fp32_values():
    # Distinct logits per row: bf16 has few values, and ties between experts are broken differently by torch.topk
    # (unspecified order) and by the kernel (lowest expert index first).
    g = torch.Generator().manual_seed(3)
    grid = (torch.arange(16) - 8) * 0.25  # exactly representable in bf16
    logits = torch.stack([grid[torch.randperm(16, generator=g)] for _ in range(30)]).to(DEVICE, torch.bfloat16)
    assert_same(router(logits, 4, "sigmoid"), router_reference(logits.float(), 4, "sigmoid"))


def test_the_kernel_runs_on_cuda_or_in_the_interpreter_and_plain_cpu_runs_the_reference(monkeypatch):
    logits = torch.randn(4, 5, device=DEVICE, requires_grad=True)
    assert type(router(logits, 2).weights.grad_fn).__name__ == "_RouterFunctionBackward"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = router(logits.detach().cpu().requires_grad_(), 2)
    assert type(cpu.weights.grad_fn).__name__ != "_RouterFunctionBackward"


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="1 <= k <= num_experts"):
        router(torch.randn(3, 4), 5)
    with pytest.raises(ValueError, match="score_function"):
        router(torch.randn(3, 4), 2, "relu")
    with pytest.raises(ValueError, match="expert_bias"):
        router(torch.randn(3, 4), 2, expert_bias=torch.zeros(5))
