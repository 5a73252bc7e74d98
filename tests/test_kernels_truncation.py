"""truncation_floor: the Triton search (on CUDA, else in Triton's CPU interpreter) against its torch reference (a sort),
and sample_categorical drawing under a floor.

The floors must be equal exactly: each is one of the row's own logits, found by counting (top-k) or by comparing
masses (top-p); the two sum the masses in other orders, so a row whose nucleus boundary sat within fp32 rounding of
top_p could differ, which the seeds here do not hold (a fixed input: the test cannot flake). What the floors mean is
checked against the definitions, on the reference: top-k keeps the k largest and their ties, top-p the smallest set of
whole tie groups holding top_p of the (top-k renormalised) mass."""

import pytest
import torch
from kernels_interpreter import DEVICE, kernels_on_device  # noqa: F401  (first: before triton is imported)

import kernels.sample as sample_module
from kernels.sample import sample_categorical, sample_categorical_reference
from kernels.truncation import truncation_floor, truncation_floor_reference

V = 3000


def _rows(dtype, seed=0):
    """Eight rows of logits: Gaussian (bf16 has many ties), one with masked columns, one flat, one peaked; each with
    its temperature, top-k and top-p."""
    g = torch.Generator().manual_seed(seed)
    logits = 2.5 * torch.randn(8, V, generator=g)
    logits[1, ::3] = float("-inf")
    logits[2] = 0.25 * torch.randn(V, generator=g)  # flat: a wide nucleus
    logits[3, 17] = 40.0  # peaked: the nucleus is one token
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.0, 2.0, 1.0, 0.9])
    top_k = torch.tensor([0, 5, 0, 50, 1, V, V + 7, 200], dtype=torch.float32)
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.3, 0.01, 1.0, 0.8])
    return [t.to(DEVICE) for t in (logits.to(dtype), temperature, top_k, top_p)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("split", [False, True], ids=["whole_rows", "split_rows"])
def test_the_searched_floor_is_the_sorted_ones(dtype, split, monkeypatch):
    if not split:  # one program per row
        monkeypatch.setattr(sample_module, "PROGRAMS", 1)
    logits, temperature, top_k, top_p = _rows(dtype)
    for use_top_k, use_top_p in ((True, True), (True, False), (False, True)):
        got = truncation_floor(logits, temperature, top_k, top_p, use_top_k, use_top_p)
        want = truncation_floor_reference(logits, temperature, top_k, top_p, use_top_k, use_top_p)
        assert got.dtype == torch.float32 and torch.equal(got, want), (use_top_k, use_top_p, got, want)


def test_the_floor_keeps_what_top_k_and_top_p_define():
    logits, temperature, top_k, top_p = (t.cpu() for t in _rows(torch.bfloat16))
    floor = truncation_floor_reference(logits, temperature, top_k, top_p)
    x = logits.float()
    for b in range(x.shape[0]):
        kept = x[b] >= floor[b]
        k = int(top_k[b])
        if 0 < k < V:  # the k largest and every token tied with the k-th
            allowed = x[b] >= x[b].topk(k).values[-1]
        else:
            allowed = torch.ones_like(kept)
        assert bool((kept <= allowed).all())  # top-p keeps a part of what top-k keeps
        t = temperature[b].item() if temperature[b] > 0 else 1.0
        p = torch.softmax(x[b].masked_fill(~allowed, float("-inf")) / t, dim=-1)
        if top_p[b] < 1:  # kept: at least top_p of the mass; without its lowest tie group, less than top_p
            assert p[kept].sum() >= top_p[b] - 1e-6
            assert p[x[b] > floor[b]].sum() < top_p[b]
        else:  # top-k alone: exactly its tokens
            assert torch.equal(kept, allowed)
    assert int((x[3] >= floor[3]).sum()) == 1  # the peaked row's nucleus: its one token


def test_without_a_limit_every_token_stays():
    logits, temperature, _, _ = _rows(torch.float32)
    none_k = torch.zeros(8, device=DEVICE)
    none_p = torch.ones(8, device=DEVICE)
    floor = truncation_floor(logits, temperature, none_k, none_p)
    assert torch.equal(floor, logits.amin(dim=1))


@pytest.mark.parametrize("impl", [sample_categorical, sample_categorical_reference], ids=["kernel", "reference"])
def test_draws_under_a_floor_follow_the_renormalised_kept_mass_and_logprobs_stay_the_whole_distributions(impl):
    rows = 2000
    logits = torch.full((600,), -30.0)
    logits[[3, 250, 400, 599]] = torch.tensor([1.0, 2.0, 0.4, 0.5])
    temperature = torch.full((rows,), 0.8, device=DEVICE)
    floor = torch.full((rows,), 0.5, device=DEVICE)  # keeps 3, 250 and 599
    wide = logits.to(DEVICE).expand(rows, 600)
    tokens, logprobs = impl(wide, temperature, torch.tensor([5], device=DEVICE), floor)
    want = torch.softmax(logits.masked_fill(logits < 0.5, float("-inf")) / 0.8, dim=-1)
    got = torch.bincount(tokens.cpu(), minlength=600).float() / rows
    assert set(tokens.tolist()) == {3, 250, 599}
    assert (got - want).abs().max().item() < 0.035, (got[[3, 250, 599]], want[[3, 250, 599]])
    whole = torch.log_softmax(logits / 0.8, dim=-1)
    torch.testing.assert_close(logprobs.cpu(), whole[tokens.cpu()], rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused_with_what_was_expected():
    logits = torch.zeros(2, 5, device=DEVICE)
    two, three = torch.ones(2, device=DEVICE), torch.ones(3, device=DEVICE)
    with pytest.raises(ValueError, match=r"top_k, top_p \[B\]"):
        truncation_floor(logits, two, three, two)
    with pytest.raises(ValueError, match=r"floor \[B\]"):
        sample_categorical(logits, two, torch.tensor([1], device=DEVICE), three)
