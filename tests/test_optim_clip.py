"""`optim.clip_and_step`: clipping folded into the AdamW kernel (as its gradient divisor) gives the same update as
`clip_grad_norm_` followed by torch AdamW's step, clipped or not, from one step to the next; the gradients are only
read. Other optimizers step on gradients clipped in place. Tolerance: 1e-6 relative (the same fp32 arithmetic; the kernel divides where torch multiplies by the factor)."""

from __future__ import annotations

import pytest
import torch

from services.trainer.optim import MasterWeightAdamW, clip_and_step

HYPER = dict(lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def params_with_grads(seed: int, grad_size: float) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((7, 5), (5,), (3, 4, 2))]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen) * grad_size
    return ps


@pytest.mark.parametrize("max_norm", [1.0, 0.0], ids=["clip", "no_clip"])
def test_clip_and_step_matches_clip_grad_norm_then_step(max_norm):
    ref, ours = params_with_grads(0, 10.0), params_with_grads(0, 10.0)
    ref_opt = torch.optim.AdamW(ref, foreach=False, **HYPER)
    opt = MasterWeightAdamW(ours, keep_fp32=tuple(ours), **HYPER)
    for size in (10.0, 0.01, 10.0):  # clipped, then not: a later unclipped step must not keep the old divisor
        grads = [p.grad.clone() for p in ours]
        ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm) if max_norm else None
        ref_opt.step()
        norm = clip_and_step(opt, ours, max_norm)
        if ref_norm is not None:
            torch.testing.assert_close(norm, ref_norm)
        if max_norm:  # a device scalar every step (no host sync to decide), 1 when the norm is below max_norm
            assert float(opt.grad_scale) == pytest.approx(max(1.0, float(norm) / max_norm), rel=1e-6)
        else:
            assert opt.grad_scale is None
        for a, b, g in zip(ours, ref, grads):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            assert torch.equal(a.grad, g), "the kernel only reads the gradients"
        gen = torch.Generator().manual_seed(int(size * 100))
        for a, b in zip(ours, ref):
            a.grad = torch.randn(a.shape, generator=gen) * size
            b.grad = a.grad.clone()


def test_any_other_optimizer_steps_on_gradients_clipped_in_place():
    ref, ours = params_with_grads(1, 10.0), params_with_grads(1, 10.0)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    torch.optim.SGD(ref, lr=0.1).step()
    norm = clip_and_step(torch.optim.SGD(ours, lr=0.1), ours, 1.0)
    torch.testing.assert_close(norm, ref_norm)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
