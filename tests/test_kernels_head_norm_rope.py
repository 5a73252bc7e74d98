"""head_norm_rope: the Triton kernels (on CUDA, else in Triton's CPU interpreter) against the torch reference.

Forward: both compute QK-norm and RoPE in fp32 and round to the heads' dtype at the same two points (after the norm's
scale, after the rotation), so bf16 outputs may differ only where an fp32 rounding-level difference (libdevice vs
torch's cos/sin and rsqrt, FMA contraction, the order of the sum of squares) crosses a bf16 rounding boundary: at most
1 bf16 ulp, and on almost no element (at least 99% bit-identical; rounding the normed heads at another point, e.g.
before the scale, would differ on a quarter of them). fp32 heads: within rtol 1e-5 / atol 1e-6.

Backward: the same formulas; sums (over head_dim for rstd and the norm's projection, over all rows for the scales'
gradients) run in another order in fp32. fp32 heads: rtol 1e-4 / atol 1e-5. bf16 heads: dq, dk within 1 bf16 ulp of
the reference, up to the fp32 differences above; the scales' gradients within rtol 1e-2 (the reference rounds them to
bf16, the gradient of the bf16-cast scale, where the kernel keeps the fp32 sum: 2^-8 relative, plus order).
"""

import pytest
import torch
from kernels_interpreter import DEVICE, ON_CUDA, kernels_on_device  # noqa: F401  (first: before triton is imported)

from kernels.head_norm_rope import head_norm_rope, head_norm_rope_reference
from services.common.config import ModelConfig
from services.trainer.model import attention
from services.trainer.model.rope import rope_frequencies

# (tokens, q heads, k heads, head_dim, QK-norm scales, heads' dtype)
CASES = [
    (13, 4, 2, 64, True, torch.bfloat16),  # GQA, tokens not a multiple of any block
    (8, 3, 3, 128, True, torch.bfloat16),  # as many k heads as q heads, a head count no block divides
    (37, 6, 1, 128, False, torch.bfloat16),  # RoPE only
    (5, 2, 2, 64, True, torch.float32),
    (21, 4, 2, 128, False, torch.float32),
]


def inputs(T, Hq, Hk, d, scaled, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(Hq, T, d, generator=gen).transpose(0, 1)  # not contiguous, as a transposed view would be
    k = 3 * torch.randn(T, Hk, d, generator=gen) + 1
    scales = [torch.rand(d, generator=gen) + 0.5 for _ in range(2)] if scaled else [None, None]
    positions = torch.randint(0, 8192, (T,), generator=gen)  # long documents: large angles
    tensors = [t.to(DEVICE) if t is not None else None for t in (q.to(dtype), k.to(dtype), *scales, positions)]
    return tensors + [rope_frequencies(d, 1e6, DEVICE)]


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of the bf16 spacing at the larger magnitude of the two."""
    big = torch.maximum(got.float().abs(), want.float().abs()).clamp_min(2.0 ** -100)
    spacing = torch.ldexp(torch.ones_like(big), torch.frexp(big).exponent - 8)
    return (got.float() - want.float()).abs() / spacing


def assert_within_one_ulp(got: torch.Tensor, want: torch.Tensor, exact_share: float | None = 0.99) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert ulps(got, want).max() <= 1.0
    if exact_share is not None:
        assert (got == want).float().mean() >= exact_share


def run(fn, q, k, q_scale, k_scale, position_ids, inv_freq, grads=None):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (q, k, q_scale, k_scale)]
    outs = fn(*leaves, 1e-6, position_ids, inv_freq)
    if grads is None:
        return [o.detach() for o in outs]
    torch.autograd.backward(outs, grads)
    return [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("T,Hq,Hk,d,scaled,dtype", CASES)
def test_forward_is_the_reference_to_the_rounding(T, Hq, Hk, d, scaled, dtype):
    args = inputs(T, Hq, Hk, d, scaled, dtype)
    got, want = run(head_norm_rope, *args), run(head_norm_rope_reference, *args)
    for g, w in zip(got, want):
        if dtype == torch.bfloat16:
            assert_within_one_ulp(g, w)
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T,Hq,Hk,d,scaled,dtype", CASES)
def test_gradients_are_the_references(T, Hq, Hk, d, scaled, dtype):
    args = inputs(T, Hq, Hk, d, scaled, dtype)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(T, H, d, generator=gen).to(dtype).to(DEVICE) for H in (Hq, Hk)]
    got = run(head_norm_rope, *args, grads=grads)
    want = run(head_norm_rope_reference, *args, grads=grads)
    assert len(got) == len(want) == (4 if scaled else 2)
    for g, w in zip(got[:2], want[:2]):
        if dtype == torch.bfloat16:
            assert_within_one_ulp(g, w, exact_share=None)
        else:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    for g, w in zip(got[2:], want[2:]):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=1e-2 if dtype == torch.bfloat16 else 1e-4, atol=1e-4)


def test_autograd_runs_the_kernel_where_triton_runs():
    q, k, qs, ks, pos, inv_freq = inputs(4, 2, 1, 64, True, torch.bfloat16)
    out, _ = head_norm_rope(q.requires_grad_(), k, qs, ks, 1e-6, pos, inv_freq)
    assert type(out.grad_fn).__name__ == "_HeadNormRopeFunctionBackward"


@pytest.mark.parametrize("compile", [False, True])
def test_attention_runs_the_kernels_where_triton_runs_compiled_or_not(compile, monkeypatch):
    calls = []

    def spy(*args):
        calls.append(args[0].shape)
        return head_norm_rope(*args)

    monkeypatch.setattr(attention, "fused_head_norm_rope", spy)
    torch.manual_seed(0)
    attn = attention.Attention(ModelConfig(hidden_size=64, num_heads=4, num_kv_heads=2, qk_norm=True,
                                           compile=compile)).to(DEVICE)
    x, positions = torch.randn(9, 64, device=DEVICE), torch.arange(9, device=DEVICE)
    q, k, _ = attn.qkv(x, positions)
    assert calls == [(9, 4, 16)]
    T = x.shape[0]
    want = head_norm_rope_reference(attn.q_proj(x).view(T, -1, 16), attn.k_proj(x).view(T, -1, 16),
                                    attn.q_norm.weight, attn.k_norm.weight, attn.norm_eps, positions, attn.inv_freq)
    torch.testing.assert_close(q, want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k, want[1], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(ON_CUDA, reason="CPU tensors without the interpreter")
def test_cpu_without_the_interpreter_runs_the_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    q, k, qs, ks, pos, inv_freq = inputs(4, 2, 1, 64, True, torch.bfloat16)
    out, _ = head_norm_rope(q.requires_grad_(), k, qs, ks, 1e-6, pos, inv_freq)
    assert type(out.grad_fn).__name__ != "_HeadNormRopeFunctionBackward"


def test_bad_arguments_name_the_problem():
    q, k, qs, ks, pos, inv_freq = inputs(4, 2, 1, 64, True, torch.float32)
    with pytest.raises(ValueError, match="head_dim a power of two"):
        odd = torch.zeros(4, 2, 96, device=DEVICE)
        head_norm_rope(odd, odd, None, None, 1e-6, pos, rope_frequencies(96, 1e6, DEVICE))
    with pytest.raises(ValueError, match="wants q "):
        head_norm_rope(q[0], k, qs, ks, 1e-6, pos, inv_freq)
    with pytest.raises(ValueError, match="wants k "):
        head_norm_rope(q, k[:3], qs, ks, 1e-6, pos, inv_freq)
    with pytest.raises(ValueError, match="k_scale"):
        head_norm_rope(q, k, qs, ks[:32], 1e-6, pos, inv_freq)
    with pytest.raises(ValueError, match="both q_scale and k_scale"):
        head_norm_rope(q, k, qs, None, 1e-6, pos, inv_freq)
    with pytest.raises(ValueError, match="position_ids"):
        head_norm_rope(q, k, qs, ks, 1e-6, pos[:3], inv_freq)
    with pytest.raises(ValueError, match="inv_freq"):
        head_norm_rope(q, k, qs, ks, 1e-6, pos, inv_freq[:3])
    with pytest.raises(ValueError, match="dtype"):
        head_norm_rope(q, k.double(), qs, ks, 1e-6, pos, inv_freq)
