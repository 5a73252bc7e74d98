"""linear_cross_entropy_sum: the chunked output layer + cross-entropy, Triton row step (on CUDA, else in Triton's CPU
interpreter) and torch row step, against the unfused path `cross_entropy_sum(h @ W.T, labels)` the trainer uses.

Tolerances: in fp32 both sides do the same arithmetic up to the order of sums (over chunks, over the vocabulary in
blocks): rtol 1e-5, atol 1e-6 on the loss and both gradients. In bf16 both sides round the logits and the logits'
gradient to bf16, so single elements may differ by a bf16 ulp; the loss must agree to rtol/atol 1e-4 (an fp32 sum of
fp32 row losses in another order), and each gradient's normwise error against the float64 truth may be at most 1.5x
the unfused bf16 path's (measured: 1.0x for the torch row step; 1.2x for the Triton row step in the CPU interpreter,
whose fp32->bf16 conversion truncates where the GPU rounds to nearest).
"""

import pytest
import torch
from kernels_interpreter import DEVICE, kernels_on_device  # noqa: F401  (first: before triton is imported)

from kernels.cross_entropy import (ce_rows_reference, ce_rows_triton, default_chunk_size, linear_cross_entropy_sum,
                                   linear_cross_entropy_sum_reference)
from services.trainer.model.loss import IGNORE_INDEX, cross_entropy_sum

FUSED = {"triton": linear_cross_entropy_sum, "torch": linear_cross_entropy_sum_reference}


def make_case(T, H, V, dtype=torch.float32, ignored=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    w = (torch.randn(V, H, generator=g) * H ** -0.5 * 4).to(DEVICE, dtype)  # logits of order 4: a peaked softmax
    labels = torch.randint(0, V, (T,), generator=g)
    labels[torch.randperm(T, generator=g)[:ignored]] = IGNORE_INDEX
    return h, w, labels.to(DEVICE)


def loss_and_grads(fn, h, w, labels, scale=1.0, **kw):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(h, w, labels, **kw)
    loss.mul(scale).backward()
    return loss.detach(), h.grad, w.grad


def unfused(h, w, labels):
    return cross_entropy_sum(h @ w.T, labels)


# T, H, V, chunk: one chunk; several chunks with a ragged tail; V not a power of two and over the first 4096-column
# block (the Triton row loop takes several blocks); one row per chunk.
CASES = [(8, 16, 40, 64), (37, 24, 100, 8), (20, 8, 5000, 7), (5, 12, 33, 1)]


@pytest.mark.parametrize("T,H,V,chunk", CASES)
@pytest.mark.parametrize("impl", sorted(FUSED))
def test_fp32_loss_and_gradients_equal_the_unfused_path(impl, T, H, V, chunk):
    h, w, labels = make_case(T, H, V)
    got = loss_and_grads(FUSED[impl], h, w, labels, scale=1 / 7, chunk_size=chunk)  # scale: the trainer's 1/tokens
    want = loss_and_grads(unfused, h, w, labels, scale=1 / 7)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def relative_error(got, truth):
    return ((got.double() - truth).norm() / truth.norm()).item()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("autocast", [True, False], ids=["autocast-fp32-params", "bf16-tensors"])
@pytest.mark.parametrize("impl", sorted(FUSED))
def test_bf16_is_as_accurate_as_the_unfused_bf16_path(impl, autocast, seed):
    # The trainer's setting is bf16 autocast over fp32 parameters (gradients come back fp32); plain bf16 tensors give
    # bf16 gradients. Both paths are measured against the float64 truth.
    dtype = torch.float32 if autocast else torch.bfloat16
    h, w, labels = make_case(48, 32, 300, dtype=dtype, seed=seed)
    truth = loss_and_grads(unfused, h.double(), w.double(), labels)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
        got = loss_and_grads(FUSED[impl], h, w, labels, chunk_size=16)
        want = loss_and_grads(unfused, h, w, labels)
    assert got[1].dtype == got[2].dtype == dtype
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    for ours, theirs, exact in zip(got[1:], want[1:], truth[1:]):
        assert relative_error(ours, exact) <= 1.5 * relative_error(theirs, exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_row_step_equals_the_torch_row_step(dtype):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(9, 5000, generator=g) * 3).to(DEVICE, dtype)
    labels = torch.randint(0, 5000, (9,), generator=g).to(DEVICE)
    labels[4] = IGNORE_INDEX
    got_block, want_block = logits.clone(), logits.clone()
    got, want = ce_rows_triton(got_block, labels, True), ce_rows_reference(want_block, labels, True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_block, want_block, rtol=1e-5 if dtype == torch.float32 else 1.6e-2, atol=1e-6)
    assert got[4] == 0 and not got_block[4].any()  # an ignored row: no loss, no gradient
    unchanged = logits.clone()
    ce_rows_triton(unchanged, labels, False)
    assert torch.equal(unchanged, logits)  # without write_grad the block is only read


def test_the_kernel_ignores_the_label_the_trainer_ignores():
    import kernels.cross_entropy as ce

    assert ce.IGNORE_INDEX == IGNORE_INDEX  # kernels/ does not import services/: the constant is repeated there


def test_all_ignored_tokens_give_zero_loss_and_zero_gradients():
    h, w, labels = make_case(6, 8, 20)
    labels[:] = IGNORE_INDEX
    loss, grad_h, grad_w = loss_and_grads(linear_cross_entropy_sum, h, w, labels, chunk_size=4)
    assert loss == 0 and not grad_h.any() and not grad_w.any()


def test_without_grad_only_the_loss_is_computed():
    h, w, labels = make_case(10, 8, 30)
    with torch.no_grad():
        loss = linear_cross_entropy_sum(h.requires_grad_(), w, labels, chunk_size=3)
    torch.testing.assert_close(loss, unfused(h.detach(), w, labels), rtol=1e-5, atol=1e-6)
    assert loss.grad_fn is None


def test_a_second_backward_names_the_cause():
    h, w, labels = make_case(4, 8, 10)
    loss = linear_cross_entropy_sum(h.requires_grad_(), w, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="gradients in forward"):
        loss.backward()


def test_the_kernel_runs_on_cuda_or_in_the_interpreter_and_plain_cpu_runs_the_reference(monkeypatch):
    import kernels.cross_entropy as ce

    calls = []
    for name in ("ce_rows_triton", "ce_rows_reference"):
        monkeypatch.setattr(ce, name, lambda *a, _f=getattr(ce, name), _n=name: calls.append(_n) or _f(*a))
    h, w, labels = make_case(4, 8, 10)
    ce.linear_cross_entropy_sum(h, w, labels)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ce.linear_cross_entropy_sum(h.cpu(), w.cpu(), labels.cpu())
    assert calls == ["ce_rows_triton", "ce_rows_reference"]


def test_default_chunk_keeps_the_logits_block_near_one_gib():
    rows = default_chunk_size(151936, torch.bfloat16)
    assert rows % 256 == 0 and rows * 151936 * 2 <= 1 << 30 < (rows + 256) * 151936 * 2
    assert default_chunk_size(10**9, torch.float32) == 256  # never below one GEMM-sized block


def test_bad_inputs_name_the_problem():
    h, w, labels = make_case(4, 8, 10)
    with pytest.raises(ValueError, match=r"h \[T, H\], weight \[V, H\], labels \[T\]"):
        linear_cross_entropy_sum(h, w[:, :4], labels)
    with pytest.raises(ValueError, match="torch.autocast"):
        linear_cross_entropy_sum(h, w.bfloat16(), labels)
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        linear_cross_entropy_sum(h, w, labels, chunk_size=0)


def test_the_model_with_the_cross_entropy_kernel_trains_like_the_unfused_model():
    # Through the trainer's step (labels into the model): same summed loss and every parameter's gradient, fp32.
    from parallel_harness import make_batches, tiny_config

    from services.trainer.model.transformer import MoETransformer
    from services.trainer.step import count_loss_tokens, forward_backward

    cfg = tiny_config().model
    mbs = make_batches(cfg, steps=1, micro=2, tokens=32)[0]
    runs = []
    for kernels in ([], ["cross_entropy"]):
        cfg.moe_kernels = kernels
        model = MoETransformer(cfg)
        model.init_weights(3)
        loss = forward_backward(model, mbs, count_loss_tokens(mbs), torch.device("cpu"), None)
        runs.append((loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss_plain, grads_plain), (loss_fused, grads_fused) = runs
    torch.testing.assert_close(loss_fused, loss_plain, rtol=1e-5, atol=1e-6)
    assert grads_fused.keys() == grads_plain.keys()
    for name, g in grads_plain.items():
        torch.testing.assert_close(grads_fused[name], g, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_to_rounds_the_scaled_fp32_sum_once(dtype):
    """The backward's last pass over grad_W: fp32 times the incoming scalar, rounded once to the weight's dtype."""
    from kernels.cross_entropy import scale_to

    src = torch.randn(37, 4099, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    scale = torch.tensor(0.37, device=DEVICE)
    want = (src * 0.37).to(dtype)
    got = scale_to(src.clone(), scale, dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
