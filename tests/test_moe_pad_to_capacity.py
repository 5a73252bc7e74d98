"""Pad-to-capacity (`model.pad_to_capacity` with `model.capacity_factor`): every expert gets exactly its capacity of
rows — its kept copies, then zero rows of router weight 0 — which change nothing the layer computes, and under expert
parallelism make the all-to-all's sizes known without exchanging counts. EP parity: tests/test_parallel_ep.py; on
CUDA, no host sync in forward and backward: tests/test_moe_sync_free.py."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

from parallel_harness import tiny_config
from services.common.config import ConfigError, validate
from services.trainer.model.moe.dispatcher import permute
from services.trainer.model.moe.router import expert_capacity, expert_counts
from services.trainer.parallel.expert_parallel import AllToAllDispatcher
from test_moe_layer import make_layer

T, E, K = 40, 6, 2


def layers(**overrides):
    """(padded, unpadded) fp32 layers with the same weights and capacity factor."""
    padded = make_layer(pad_to_capacity=True, **overrides).float().train()
    plain = copy.deepcopy(padded)
    plain.router.cfg = dataclasses.replace(padded.router.cfg, pad_to_capacity=False)
    return padded, plain


def run(layer, x, g):
    x = x.clone().requires_grad_()
    layer.zero_grad()
    out = layer(x)
    (out * g).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


CASES = {
    "drops": {"capacity_factor": 0.8},
    "padding_only": {"capacity_factor": 2.0},
    "sigmoid_shared_aux_z": {"capacity_factor": 0.9, "score_func": "sigmoid", "shared_expert_ffn_hidden_size": 8,
                             "aux_loss_coeff": 0.1, "z_loss_coeff": 1e-2},
}


@pytest.mark.parametrize("recompute_dispatch", [False, True], ids=["", "recompute_moe_dispatch"])
@pytest.mark.parametrize("case", CASES)
def test_padded_moe_layer_output_and_every_gradient_equal_the_unpadded_layers(case, recompute_dispatch):
    """Same capacity drops, same outputs, same gradients of the input and of every parameter: to fp32 rounding
    (rtol 1e-5, atol 1e-6; the expert GEMMs see more rows)."""
    padded, plain = layers(**CASES[case])
    for layer in (padded, plain):  # `model.recompute: [moe_dispatch]`: the rows rebuilt in backward, padding included
        layer.recompute_dispatch = recompute_dispatch
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(T, 16, generator=gen), torch.randn(T, 16, generator=gen)
    routing = padded.router(x)
    counts = expert_counts(routing.expert_ids, E, routing.kept)
    assert routing.capacity == expert_capacity(T, K, E, CASES[case]["capacity_factor"])
    assert int(counts.min()) < routing.capacity, "some expert must be padded"
    if case != "padding_only":
        assert not bool(routing.kept.all()), "the capacity must drop copies"
    got, want = run(padded, x, g), run(plain, x, g)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-5, atol=1e-6, msg=f"gradient of {name}")


def test_padded_dispatch_gives_each_expert_exactly_its_capacity_its_kept_rows_then_zero_rows_of_weight_zero():
    padded, _ = layers(capacity_factor=0.75)
    x = torch.randn(T, 16, generator=torch.Generator().manual_seed(2))
    routing = padded.router(x)
    cap = routing.capacity
    d = padded.dispatcher.dispatch(x, routing)
    assert d.tokens_per_expert.tolist() == [cap] * E and d.hidden.shape == (E * cap, 16)
    rows, weights, kept_counts, _ = permute(x, routing, E)  # the unpadded rows, grouped by expert
    start = 0
    for e, n in enumerate(kept_counts.tolist()):
        block = slice(e * cap, (e + 1) * cap)
        assert torch.equal(d.hidden[block][:n], rows[start:start + n]), f"expert {e}: its kept rows, in order"
        assert torch.equal(d.weights[block][:n], weights[start:start + n])
        assert not d.hidden[block][n:].any() and not d.weights[block][n:].any(), f"expert {e}: padding not zero"
        start += n


@pytest.mark.parametrize("pad", [True, False], ids=["padded", "unpadded"])
def test_all_to_all_dispatch_with_pad_to_capacity_exchanges_no_counts(one_rank_group, monkeypatch, pad):
    """The structural half of sync-freedom, checkable on a CPU: with padding, forward and backward issue only the rows'
    and weights' all-to-alls (3 each way), no per-expert count exchange, whose result the host would have to read
    back before it could size the transfer. Outputs and input gradients equal the local dispatch's exactly."""
    padded, plain = layers(capacity_factor=0.75)
    layer = padded if pad else plain
    x, g = torch.randn(T, 16), torch.randn(T, 16)
    local = run(layer, x, g)
    calls = []
    real = dist.all_to_all_single
    monkeypatch.setattr(dist, "all_to_all_single", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    layer.dispatcher = AllToAllDispatcher(E, one_rank_group, ep=1, etp=1)
    got = run(layer, x, g)
    assert len(calls) == (6 if pad else 7)
    assert torch.equal(got[0], local[0]) and torch.equal(got[1], local[1])


@pytest.mark.parametrize("overrides, keys", [
    ({"model.capacity_factor": 0.0}, r"model\.pad_to_capacity.*model\.capacity_factor"),
    ({"parallel.ep": 2, "parallel.dispatcher": "allgather"}, r"model\.pad_to_capacity.*parallel\.dispatcher"),
    ({"parallel.ep": 2, "parallel.cp": 2, "parallel.cp_sizes": [1, 2]}, r"model\.pad_to_capacity.*parallel\.cp_sizes"),
], ids=["no_capacity_factor", "allgather_dispatcher", "dynamic_cp_under_ep"])
def test_config_refuses_pad_to_capacity_where_it_cannot_run_naming_the_keys(overrides, keys):
    cfg = tiny_config()
    cfg.model.pad_to_capacity, cfg.model.capacity_factor = True, 1.0
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError, match=keys):
        validate(cfg)
