"""permute: the Triton kernel (on CUDA, else in Triton's CPU interpreter) against the torch reference, and the
reference against its definition. Forward permute only copies values, so it must match exactly in fp32 and bf16;
the backward sums k rows per token (tolerance in its test)."""

import pytest
import torch
from kernels_interpreter import DEVICE, ON_CUDA, kernels_on_device  # noqa: F401  (first: before triton is imported)

from kernels.permute import Permutation, permute, permute_reference


def random_routing(T: int, k: int, E: int, seed: int, drop_every: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.empty(0, k)
    indices = indices.long()
    if drop_every:
        indices[::drop_every, -1] = -1  # capacity overflow: the token's last choice is dropped
    return indices.to(DEVICE)


def naive_permute(hidden, indices, E):
    """The definition, by loops: expert by expert, tokens in order; dropped copies become zero rows at the end."""
    T, k = indices.shape
    rows, row_id_map, dropped = [], torch.empty(T, k, dtype=torch.int64), []
    for e in range(E):
        for t in range(T):
            for j in range(k):
                if indices[t, j] == e:
                    row_id_map[t, j] = len(rows)
                    rows.append(hidden[t])
    counts = torch.tensor([(indices == e).sum().item() for e in range(E)])
    for t in range(T):
        for j in range(k):
            if indices[t, j] < 0:
                row_id_map[t, j] = -(len(rows) + len(dropped)) - 1
                dropped.append(torch.zeros_like(hidden[t]))
    permuted = torch.stack(rows + dropped) if rows + dropped else hidden.new_zeros(0, hidden.shape[1])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    return permuted, row_id_map, counts, offsets


def assert_same(a: Permutation, b: Permutation) -> None:
    assert torch.equal(a.permuted, b.permuted)
    assert torch.equal(a.row_id_map, b.row_id_map)
    assert torch.equal(a.tokens_per_expert, b.tokens_per_expert)
    assert torch.equal(a.offsets, b.offsets)
    assert (a.permuted_probs is None) == (b.permuted_probs is None)
    if a.permuted_probs is not None:
        assert torch.equal(a.permuted_probs, b.permuted_probs)


# T, k, E, h: one token; k=1; E=1; E not a power of two; more token blocks than one (64 tokens per block up to 31
# experts, 16 from 128); more expert blocks than one (256 buckets per block).
SHAPES = [(1, 1, 1, 8), (1, 2, 5, 3), (9, 1, 3, 16), (37, 3, 7, 20), (130, 2, 5, 9), (70, 4, 21, 12),
          (70, 4, 300, 8)]


def test_reference_matches_the_definition_including_dropped_copies():
    # On the host whatever the machine: the definition loops in Python over CPU tensors.
    T, k, E, h = 23, 3, 6, 5
    hidden = torch.randn(T, h)
    indices = random_routing(T, k, E, seed=1, drop_every=4).cpu()
    ref = permute_reference(hidden, indices, E)
    permuted, row_id_map, counts, offsets = naive_permute(hidden, indices, E)
    assert torch.equal(ref.permuted, permuted)
    assert torch.equal(ref.row_id_map.long(), row_id_map)
    assert torch.equal(ref.tokens_per_expert.long(), counts)
    assert torch.equal(ref.offsets.long(), offsets)


@pytest.mark.parametrize("T,k,E,h", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(T, k, E, h, dtype):
    hidden = torch.randn(T, h, device=DEVICE).to(dtype)
    indices = random_routing(T, k, E, seed=T * 100 + E)
    probs = torch.rand(T, k, device=DEVICE)
    assert_same(permute(hidden, indices, E, probs), permute_reference(hidden, indices, E, probs))


def test_kernel_matches_reference_with_dropped_copies_and_int32_indices():
    T, k, E, h = 70, 3, 9, 11
    hidden = torch.randn(T, h, device=DEVICE)
    indices = random_routing(T, k, E, seed=7, drop_every=3)
    indices[5] = -1  # a token with every copy dropped: its dropped slots need distinct tail rows
    indices = indices.int()
    out = permute(hidden, indices, E)
    assert_same(out, permute_reference(hidden, indices, E))
    assert out.offsets[-1] == (indices >= 0).sum()
    assert torch.all(out.permuted[out.offsets[-1]:] == 0)


def test_experts_with_no_tokens_get_empty_row_ranges():
    T, k, E, h = 12, 2, 6, 4
    g = torch.Generator().manual_seed(3)
    allowed = torch.tensor([0, 1, 3])  # experts 2, 4 and 5 are never chosen
    indices = torch.stack([allowed[torch.randperm(3, generator=g)[:k]] for _ in range(T)]).to(DEVICE)
    hidden = torch.randn(T, h, device=DEVICE)
    out = permute(hidden, indices, E)
    assert out.tokens_per_expert[[2, 4, 5]].tolist() == [0, 0, 0]
    assert out.offsets[2] == out.offsets[3] and out.offsets[4] == out.offsets[5] == out.offsets[6] == T * k
    assert_same(out, permute_reference(hidden, indices, E))


def test_rows_are_grouped_by_expert_in_token_order():
    T, k, E, h = 40, 3, 5, 2
    hidden = torch.arange(T, dtype=torch.float32, device=DEVICE).unsqueeze(1).repeat(1, h)  # row value = token id
    indices = random_routing(T, k, E, seed=11)
    out = permute(hidden, indices, E)
    for e in range(E):
        tokens = out.permuted[out.offsets[e]:out.offsets[e + 1], 0]
        assert torch.equal(tokens, (indices == e).any(1).nonzero().squeeze(1).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_reference(dtype):
    # The hidden gradient sums each token's k row gradients: the kernel accumulates in fp32 and rounds once, so it is
    # compared with the reference run in fp32 on the same values, to fp32 (rtol 1.3e-6) or bf16 (rtol 1.6e-2) rounding.
    T, k, E, h = 33, 3, 7, 10
    indices = random_routing(T, k, E, seed=5, drop_every=5)
    hidden = torch.randn(T, h, device=DEVICE).to(dtype)
    probs = torch.rand(T, k, device=DEVICE)
    grad_rows = torch.randn(T * k, h, device=DEVICE).to(dtype)
    grad_probs = torch.randn(T * k, device=DEVICE)

    def grads(fn, x_dtype):
        x, p = hidden.to(x_dtype).requires_grad_(), probs.clone().requires_grad_()
        out = fn(x, indices, E, p)
        loss = (out.permuted * grad_rows.to(x_dtype)).sum() + (out.permuted_probs * grad_probs).sum()
        return torch.autograd.grad(loss, (x, p))

    (got_hidden, got_probs), (want_hidden, want_probs) = grads(permute, dtype), grads(permute_reference, torch.float32)
    assert got_hidden.dtype == dtype
    torch.testing.assert_close(got_hidden, want_hidden.to(dtype))
    torch.testing.assert_close(got_probs, want_probs, rtol=0, atol=0)  # a pure gather


def test_the_kernel_runs_on_cuda_or_in_the_interpreter_and_plain_cpu_runs_the_reference(monkeypatch):
    indices = random_routing(4, 2, 3, seed=0)
    hidden = torch.randn(4, 3, device=DEVICE, requires_grad=True)
    assert type(permute(hidden, indices, 3).permuted.grad_fn).__name__ == "_PermuteFunctionBackward"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = permute(hidden.detach().cpu().requires_grad_(), indices.cpu(), 3).permuted
    assert type(cpu.grad_fn).__name__ != "_PermuteFunctionBackward"


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="same T"):
        permute(torch.randn(4, 3), torch.zeros(5, 2, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="integer expert indices"):
        permute(torch.randn(4, 3), torch.zeros(4, 2), 3)


def test_permute_rows_again_rebuilds_the_permuted_rows_from_the_row_map():
    """What `model.recompute: [moe_dispatch]` runs in backward: the data pass alone gives the same rows."""
    from kernels.permute import permute, permute_rows_again

    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(20, 16, generator=gen).to(DEVICE)
    indices = torch.stack([torch.randperm(6, generator=gen)[:3] for _ in range(20)]).to(DEVICE)
    indices[::4, 1] = -1  # dropped copies: zero rows in the tail
    perm = permute(hidden, indices, 6)
    again = permute_rows_again(hidden, perm.row_id_map)
    assert torch.equal(again, perm.permuted)


def test_permute_rows_again_reference_path_matches_permute_reference(monkeypatch):
    from kernels.permute import permute_reference, permute_rows_again

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CPU reference path, not the interpreter
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(12, 8, generator=gen)
    indices = torch.stack([torch.randperm(5, generator=gen)[:2] for _ in range(12)])
    indices[::3, 0] = -1
    perm = permute_reference(hidden, indices, 5)
    assert torch.equal(permute_rows_again(hidden, perm.row_id_map), perm.permuted)


# ---------------------------------------------------------------- capacity layout (model.pad_to_capacity)


def within_capacity(indices: torch.Tensor, E: int, capacity: int) -> torch.Tensor:
    """`indices` with every expert's copies past its first `capacity` (in token order) dropped, as the router's
    capacity does (which copies it keeps does not matter here)."""
    out, seen = indices.clone(), [0] * E
    for t in range(out.shape[0]):
        for j in range(out.shape[1]):
            e = int(out[t, j])
            if e >= 0:
                seen[e] += 1
                if seen[e] > capacity:
                    out[t, j] = -1
    return out


def test_capacity_layout_is_each_experts_kept_rows_then_zero_rows_and_dropped_copies_have_no_row():
    T, k, E, h, c = 23, 3, 6, 5, 11
    hidden, probs = torch.randn(T, h), torch.rand(T, k)
    indices = within_capacity(random_routing(T, k, E, seed=1, drop_every=4).cpu(), E, c)
    got = permute_reference(hidden, indices, E, probs, capacity=c)
    plain = permute_reference(hidden, indices, E, probs)  # dropless layout: expert e at rows offsets[e]..
    assert got.permuted.shape == (E * c, h) and got.permuted_probs.shape == (E * c,)
    assert got.tokens_per_expert.tolist() == [c] * E and got.offsets.tolist() == [e * c for e in range(E + 1)]
    counts = plain.tokens_per_expert.tolist()
    assert max(counts) == c and min(counts) < c, "an expert exactly full and one padded"
    for e, n in enumerate(counts):
        a = int(plain.offsets[e])
        assert torch.equal(got.permuted[e * c:e * c + n], plain.permuted[a:a + n]), f"expert {e}: its kept rows"
        assert torch.equal(got.permuted_probs[e * c:e * c + n], plain.permuted_probs[a:a + n])
        assert not got.permuted[e * c + n:(e + 1) * c].any() and not got.permuted_probs[e * c + n:(e + 1) * c].any()
    for t in range(T):
        for j in range(k):
            r = int(got.row_id_map[t, j])
            assert (r == -1) if indices[t, j] < 0 else torch.equal(got.permuted[r], hidden[t])


@pytest.mark.parametrize("T,k,E,h,c", [(37, 3, 7, 20, 12), (70, 4, 21, 12, 11), (9, 1, 3, 16, 2), (1, 2, 5, 3, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capacity_layout_kernel_matches_reference(T, k, E, h, c, dtype):
    hidden = torch.randn(T, h, device=DEVICE).to(dtype)
    indices = within_capacity(random_routing(T, k, E, seed=T * 100 + E, drop_every=5).cpu(), E, c)
    indices[0] = -1  # a token with every copy dropped
    indices = indices.to(DEVICE)
    probs = torch.rand(T, k, device=DEVICE)
    assert_same(permute(hidden, indices, E, probs, capacity=c), permute_reference(hidden, indices, E, probs, c))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capacity_layout_gradients_match_reference_and_padding_rows_send_none(dtype):
    T, k, E, h, c = 33, 3, 7, 10, 13
    indices = within_capacity(random_routing(T, k, E, seed=5, drop_every=5).cpu(), E, c).to(DEVICE)
    hidden = torch.randn(T, h, device=DEVICE).to(dtype)
    probs = torch.rand(T, k, device=DEVICE)
    grad_rows = torch.randn(E * c, h, device=DEVICE).to(dtype)  # nonzero on padding rows too
    grad_probs = torch.randn(E * c, device=DEVICE)

    def grads(fn, x_dtype, g_rows=grad_rows, g_probs=grad_probs):
        x, p = hidden.to(x_dtype).requires_grad_(), probs.clone().requires_grad_()
        out = fn(x, indices, E, p, capacity=c)
        loss = (out.permuted * g_rows.to(x_dtype)).sum() + (out.permuted_probs * g_probs).sum()
        return torch.autograd.grad(loss, (x, p))

    got, want = grads(permute, dtype), grads(permute_reference, torch.float32)
    torch.testing.assert_close(got[0], want[0].to(dtype))
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    padding = torch.ones(E * c, dtype=torch.bool, device=DEVICE)
    rows = permute(hidden, indices, E, capacity=c).row_id_map.reshape(-1)
    padding[rows[rows >= 0].long()] = False
    assert padding.any()
    noise = grads(permute, dtype, grad_rows + 100 * padding[:, None].to(dtype), grad_probs + 100 * padding)
    assert torch.equal(noise[0], got[0]) and torch.equal(noise[1], got[1]), "padding rows reached a gradient"


def test_capacity_layout_rows_again_and_bad_capacity():
    from kernels.permute import permute_rows_again

    T, k, E, h, c = 20, 3, 6, 16, 8
    hidden = torch.randn(T, h, device=DEVICE)
    indices = within_capacity(random_routing(T, k, E, seed=3, drop_every=4).cpu(), E, c).to(DEVICE)
    perm = permute(hidden, indices, E, capacity=c)
    assert torch.equal(permute_rows_again(hidden, perm.row_id_map, E * c), perm.permuted)
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        permute(hidden, indices, E, capacity=0)
