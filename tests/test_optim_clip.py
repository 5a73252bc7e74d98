"""`optim.clip_and_step`: clipping folded into the fused AdamW kernel (as its gradient scale) gives the same update as
`clip_grad_norm_` followed by a plain step, clipped or not; without the fused kernel it clips in place."""

from __future__ import annotations

import pytest
import torch

from services.trainer.optim import clip_and_step


def params_with_grads(seed: int, grad_size: float) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((7, 5), (5,), (3, 4, 2))]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen) * grad_size
    return ps


@pytest.mark.parametrize("grad_size, clipped", [(10.0, True), (0.01, False)])
@pytest.mark.parametrize("fused", [True, False])
def test_clip_and_step_matches_clip_grad_norm_then_step(grad_size, clipped, fused):
    ref, ours = params_with_grads(0, grad_size), params_with_grads(0, grad_size)
    kw = dict(lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref, foreach=False, **kw)
    opt = torch.optim.AdamW(ours, fused=fused, **kw)
    for _ in range(3):  # the scale is set anew each step; a later unclipped step must not keep an old one
        ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
        ref_opt.step()
        norm = clip_and_step(opt, ours, 1.0)
        assert (float(ref_norm) > 1.0) == clipped
        torch.testing.assert_close(norm, ref_norm)
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)  # left clipped, as clip_grad_norm_ does
        for a, b in zip(ours, ref):
            a.grad = torch.randn_like(a) * grad_size
            b.grad = a.grad.clone()


def test_no_clipping_when_max_norm_is_zero():
    ref, ours = params_with_grads(1, 10.0), params_with_grads(1, 10.0)
    torch.optim.AdamW(ref, lr=0.1, foreach=False).step()
    clip_and_step(torch.optim.AdamW(ours, lr=0.1, fused=True), ours, 0.0)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
