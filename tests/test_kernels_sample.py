"""sample_categorical: the Triton kernel (on CUDA, else in Triton's CPU interpreter) and its torch reference.

The two draw from different uniform streams (Triton's Philox, torch's generator), so what must agree exactly is what
does not depend on the draw: the greedy rows' tokens (the first maximal logit) and every row's log-prob of the token it
returned (the log-softmax of the temperature-scaled logits there, within fp32 rounding: 1e-5). The draws themselves are
checked against the distribution: over 2,000 rows of the same logits, each token's frequency within 0.035 of its
probability (4.5 standard deviations at p = 0.5, for a fixed seed: the test cannot flake)."""

import pytest
import torch
from kernels_interpreter import DEVICE, kernels_on_device  # noqa: F401  (first: before triton is imported)

import kernels.sample as sample_module
from kernels.sample import sample_categorical, sample_categorical_reference, splits_for

IMPLS = {"kernel": sample_categorical, "reference": sample_categorical_reference}


def _seed(n: int) -> torch.Tensor:
    return torch.tensor([n], dtype=torch.int64, device=DEVICE)


def _logprob_of(logits, temperature, tokens):
    t = torch.where(temperature <= 0, torch.ones_like(temperature), temperature)
    return torch.log_softmax(logits.float() / t[:, None], dim=-1).gather(1, tokens[:, None]).squeeze(1)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("V", [7, 5000])  # within one block, and over three (the last partial)
def test_greedy_rows_take_the_first_maximal_logit_and_every_logprob_is_the_scaled_log_softmax(impl, V):
    torch.manual_seed(0)
    logits = (3 * torch.randn(6, V, device=DEVICE)).to(torch.bfloat16)
    logits[0, V // 2] = logits[0, V - 1] = 50.0  # a tie: the first column wins
    logits[2, :V // 2] = float("-inf")  # masked columns (at V=5000 the kernel's first chunk of the row): never drawn
    temperature = torch.tensor([0.0, 0.0, 1.0, 0.7, 1.5, -1.0], device=DEVICE)
    tokens, logprobs = IMPLS[impl](logits, temperature, _seed(3))
    greedy = temperature <= 0
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(tokens[greedy], logits.float()[greedy].argmax(-1)) and tokens[0].item() == V // 2
    assert tokens[2].item() >= V // 2 and torch.isfinite(logprobs).all()
    torch.testing.assert_close(logprobs, _logprob_of(logits, temperature, tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("split", [False, True], ids=["whole_rows", "split_rows"])
def test_draws_follow_the_softmax_of_the_scaled_logits(impl, split, monkeypatch):
    if split:  # each row in five chunks of 128 columns
        monkeypatch.setattr(sample_module, "BLOCK_V", 128)
        monkeypatch.setattr(sample_module, "PROGRAMS", 10**6)
    V, rows = 600, 2000
    logits = torch.full((V,), -30.0)
    logits[[3, 250, 599]] = torch.tensor([1.0, 2.0, 0.5])
    temperature = torch.full((rows,), 0.8, device=DEVICE)
    tokens, _ = IMPLS[impl](logits.to(DEVICE).expand(rows, V), temperature, _seed(11))
    want = torch.softmax(logits / 0.8, dim=-1)
    got = torch.bincount(tokens.cpu(), minlength=V).float() / rows
    assert (got - want).abs().max().item() < 0.035, (got[[3, 250, 599]], want[[3, 250, 599]])


@pytest.mark.parametrize("impl", IMPLS)
def test_a_seed_reproduces_its_draws_and_another_seed_draws_others(impl):
    logits = torch.randn(64, 300, device=DEVICE)
    temperature = torch.ones(64, device=DEVICE)
    a, b, c = (IMPLS[impl](logits, temperature, _seed(s))[0] for s in (5, 5, 6))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_splitting_rows_changes_neither_the_draws_nor_the_logprobs(monkeypatch):
    """A row's cumulative distribution runs over its columns in order whatever the chunks: one program per row and
    rows split in chunks (the chunk where the draw falls, the log-sum-exp and the greedy max combined over them)
    return the same tokens."""
    torch.manual_seed(1)
    logits = (2 * torch.randn(5, 3000, device=DEVICE)).to(torch.bfloat16)
    logits[0, 10] = logits[0, 2900] = 40.0  # a greedy tie across chunks: the first column wins
    temperature = torch.tensor([0.0, 1.0, 0.5, 2.0, 1.0], device=DEVICE)
    monkeypatch.setattr(sample_module, "BLOCK_V", 256)
    monkeypatch.setattr(sample_module, "PROGRAMS", 1)
    assert splits_for(5, 3000) == (1, 3072)
    whole = sample_categorical(logits, temperature, _seed(9))
    monkeypatch.setattr(sample_module, "PROGRAMS", 10**6)
    assert splits_for(5, 3000) == (12, 256)
    split = sample_categorical(logits, temperature, _seed(9))
    assert whole[0][0].item() == 10 and torch.equal(whole[0], split[0])
    torch.testing.assert_close(whole[1], split[1], rtol=1e-6, atol=1e-6)


def test_bad_shapes_are_refused_with_what_was_expected():
    with pytest.raises(ValueError, match=r"temperature \[B\]"):
        sample_categorical(torch.zeros(2, 5), torch.zeros(3), torch.tensor([0]))
    with pytest.raises(ValueError, match="int64 tensor of shape"):
        sample_categorical(torch.zeros(2, 5), torch.zeros(2), torch.tensor([0], dtype=torch.int32))
