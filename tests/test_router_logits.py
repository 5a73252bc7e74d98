"""router_logits: fp32 router logits from bf16 GEMMs on split weights, against an fp64 reference.

Tolerances, relative to the largest reference value: logits and the fp32 weight gradient within 1e-6 on CPU, where the
bf16 parts are multiplied in fp32 and the errors are the fp32 GEMM's (1-4e-7 here), and 2e-5 on CUDA: the H100's tensor cores add the
products with fewer bits than fp32: 0.7-2.8e-6 off for the logits (fp32 GEMM 0.2-1e-6) and 1e-5 for the weight gradient
over 16,384 tokens (fp32 7.5e-7). A weight rounded to bf16 (one part) is ~1.5e-3 off. The input gradient, which is bf16,
within one bf16 rounding (2^-8) of the reference. On CUDA the same tests run the tensor-core path through
`router_logits`."""

import pytest
import torch
import torch.nn.functional as F

from services.trainer.model.moe.router_logits import SplitBf16Logits, router_logits, split_bf16

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 2e-5 if DEVICE == "cuda" else 1e-6


def logits_fn(x, w):
    return router_logits(x, w) if x.is_cuda else SplitBf16Logits.apply(x, w)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def test_three_bf16_parts_sum_to_an_fp32_tensor_exactly():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-30, 30, 256)  # magnitudes over 60 decades
    parts = split_bf16(w, 3)
    assert all(p.dtype == torch.bfloat16 for p in parts)
    assert torch.equal(sum(p.double() for p in parts), w.double())
    assert not torch.equal(sum(p.double() for p in split_bf16(w, 2)), w.double())  # two are not enough
    b = w.bfloat16()
    assert torch.equal(split_bf16(b, 1)[0], b)


@pytest.mark.parametrize("T,h,E,weight_dtype", [(256, 512, 64, torch.float32), (64, 2048, 128, torch.float32),
                                                (128, 256, 16, torch.bfloat16)])
def test_logits_and_gradients_match_fp64(T, h, E, weight_dtype):
    g = torch.Generator().manual_seed(T + h)
    x = torch.randn(T, h, generator=g).bfloat16().to(DEVICE).requires_grad_()
    w = (torch.randn(E, h, generator=g) * 0.02).to(DEVICE, weight_dtype).requires_grad_()
    grad = torch.randn(T, E, generator=g).to(DEVICE)
    logits = logits_fn(x, w)
    logits.backward(grad)

    x64, w64, g64 = x.detach().double(), w.detach().double(), grad.double()
    assert logits.dtype == torch.float32 and x.grad.dtype == torch.bfloat16 and w.grad.dtype == weight_dtype
    assert rel_err(logits, x64 @ w64.T) < TOL
    assert rel_err(x.grad, g64 @ w64) < 2**-8
    if weight_dtype == torch.float32:
        assert rel_err(w.grad, g64.T @ x64) < TOL
    else:  # the bf16 gradient: one rounding of the fp32 one
        assert rel_err(w.grad, g64.T @ x64) < 2**-8


def test_fp32_input_takes_the_plain_fp32_gemm():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(32, 64, generator=g).to(DEVICE), torch.randn(8, 64, generator=g).to(DEVICE)
    assert torch.equal(router_logits(x, w), F.linear(x, w))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the tensor-core path runs on CUDA")
def test_router_chooses_as_the_fp32_gemm_does_at_qwen3_shape():
    """At Qwen3-30B-A3B's router shape (16,384 tokens, h=2048, 128 experts, top-8) the chosen experts are the best
    under the fp64 logits wherever the fp32 GEMM's are: a token's choice may differ only between experts whose fp64
    logits are within 1e-5 of each other, as the fp32 GEMM's may."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(16384, 2048, generator=g).bfloat16().cuda()
    w = (torch.randn(128, 2048, generator=g) * 0.02).cuda()
    ref = x.double() @ w.double().T
    best = ref.topk(8).values.sum(-1)
    for logits in (router_logits(x, w), F.linear(x.float(), w)):
        chosen = ref.gather(1, logits.topk(8).indices).sum(-1)
        assert (best - chosen).max().item() < 1e-5
        torch.testing.assert_close(logits.softmax(-1), ref.softmax(-1).float(), rtol=1e-5, atol=1e-7)
