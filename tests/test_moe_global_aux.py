"""The global aux loss (`model.aux_loss_type=global`) on one rank: f over every token routed so far in the step, reset
once per optimizer step, counted once per micro-batch under recompute; the micro-batch loss when a step is one
micro-batch. The multi-rank parity (counts summed over the data-parallel replicas) is tests/test_parallel_global_aux.py;
the Triton router's path, tests/test_kernels_moe_layer.py."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from parallel_harness import make_batches, tiny_config
from services.common.config import ConfigError, validate
from services.trainer.model.moe.router import expert_counts
from services.trainer.model.recompute import apply_memory_policy
from services.trainer.model.transformer import MoETransformer
from services.trainer.step import count_loss_tokens, forward_backward
from services.trainer.train import advance_router_bias
from test_moe_layer import make_layer

CPU = torch.device("cpu")


def layer_pair(**overrides):
    """(global, micro_batch) aux layers with the same weights, float64, training mode."""
    one = make_layer(aux_loss_coeff=0.1, aux_loss_type="global", **overrides).train()
    other = copy.deepcopy(one)
    other.router.cfg = dataclasses.replace(one.router.cfg, aux_loss_type="micro_batch")
    return one, other


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("overrides", [{}, {"score_func": "sigmoid", "z_loss_coeff": 1e-2}],
                         ids=["softmax", "sigmoid_z"])
def test_global_aux_loss_of_a_one_micro_batch_step_on_one_rank_equals_the_micro_batch_loss_exactly(overrides):
    """Bitwise: the same loss value and the same gradients of every parameter and of the input."""
    results = []
    for layer in layer_pair(**overrides):
        x = tokens(13, 1).requires_grad_()
        layer(x).sum().backward()
        results.append((layer.last_aux_loss, x.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (aux_g, gx_g, grads_g), (aux_m, gx_m, grads_m) = results
    assert aux_g > 0 and torch.equal(aux_g, aux_m)
    assert torch.equal(gx_g, gx_m)
    for name, grad in grads_m.items():
        assert torch.equal(grads_g[name], grad), f"gradient of {name}"


def test_global_aux_loss_counts_f_over_every_micro_batch_routed_so_far_in_the_step():
    """Second micro-batch: coeff·E·Σ fᵢ·Pᵢ with f over both micro-batches' slots and P over the second's tokens
    (computed here in float64; the router scores in fp32: to 1e-6 relative)."""
    layer, _ = layer_pair()
    x1, x2 = tokens(11, 1), tokens(7, 2)
    r1, r2 = layer.router(x1), layer.router(x2)
    ids = torch.cat([r1.expert_ids, r2.expert_ids])
    f = expert_counts(ids, 6).double() / (ids.numel())
    probs2 = (x2 @ layer.router.weight.detach().T).softmax(-1)
    want = 0.1 * 6 * (f * probs2.mean(0)).sum()
    torch.testing.assert_close(r2.aux_loss.detach().double(), want, rtol=1e-6, atol=0)
    f_second_alone = expert_counts(r2.expert_ids, 6).double() / r2.expert_ids.numel()
    assert not torch.allclose(f, f_second_alone)  # the two micro-batches route differently: the test can tell
    assert layer.router.global_routed.tolist() == expert_counts(ids, 6).tolist() + [18]


def test_advance_router_bias_resets_the_global_statistics_so_each_step_starts_afresh():
    cfg = tiny_config()
    cfg.model.aux_loss_type = "global"
    model = MoETransformer(cfg.model)
    model.init_weights(0)
    fresh = copy.deepcopy(model)
    step1, step2 = make_batches(cfg.model, steps=2, micro=2, seed=4)
    forward_backward(model, step1, count_loss_tokens(step1), CPU, None)
    assert all(m.router.global_routed.sum() > 0 for m in model.moe_layers())
    advance_router_bias(model, cfg)  # what the training loop (and the RL loop) runs after each optimizer step
    assert all(not m.router.global_routed.any() for m in model.moe_layers())
    # The next step's aux losses are those of a model that never saw step 1 (its weights did not change here).
    forward_backward(model, step2, count_loss_tokens(step2), CPU, None)
    forward_backward(fresh, step2, count_loss_tokens(step2), CPU, None)
    for got, want in zip(model.moe_layers(), fresh.moe_layers(), strict=True):
        assert torch.equal(got.last_aux_loss, want.last_aux_loss)
        assert torch.equal(got.router.global_routed, want.router.global_routed)


def forwards_then_backwards(model, mbs) -> None:
    """Every micro-batch's forward before any backward, as a pipeline schedule keeps several in flight: a recompute
    in backward then runs after later micro-batches have added to the step's counts."""
    losses = [model(mb["tokens"], mb["position_ids"], mb["cu_seqlens"], labels=mb["labels"]) for mb in mbs]
    for loss in losses:
        loss.backward()


@pytest.mark.parametrize("policy", ["moe", "layer"])
def test_recompute_reuses_the_forwards_statistics_and_counts_each_micro_batch_once(policy):
    """`model.recompute` reruns the router in backward: it must see the f its forward saw (not one grown by later
    micro-batches, nor count its own micro-batch again). Gradients equal the run without recompute to 1e-6 relative
    (fp32; the same ops rerun), the step's counts are exact."""
    cfg = tiny_config()
    cfg.model.aux_loss_type, cfg.model.aux_loss_coeff = "global", 0.1
    plain = MoETransformer(cfg.model)
    plain.init_weights(0)
    recomputed = apply_memory_policy(copy.deepcopy(plain), [policy], [])
    (mbs,) = make_batches(cfg.model, steps=1, micro=3, seed=4)
    for model in (plain, recomputed):
        forwards_then_backwards(model, mbs)
    for got, want in zip(recomputed.moe_layers(), plain.moe_layers(), strict=True):
        assert torch.equal(got.router.global_routed, want.router.global_routed)
        assert int(got.router.global_routed[-1]) == sum(mb["tokens"].numel() for mb in mbs)
    grads = dict(plain.named_parameters())
    for name, p in recomputed.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-6, atol=1e-9, msg=f"gradient of {name}")


def test_a_no_grad_pass_adds_nothing_to_the_steps_statistics():
    """Passes without autograd (RL log-probs, evaluation in training mode) train nothing: they must not shift f."""
    layer, _ = layer_pair()
    with torch.no_grad():
        routing = layer.router(tokens(9, 1))
    assert not layer.router.global_routed.any() and float(routing.aux_loss) == 0.0


def test_config_refuses_the_global_aux_loss_with_dynamic_cp_naming_both_keys():
    cfg = tiny_config(cp=2, cp_sizes=[1, 2])
    cfg.model.aux_loss_type = "global"
    with pytest.raises(ConfigError, match=r"model\.aux_loss_type=global.*parallel\.cp_sizes"):
        validate(cfg)


def test_rl_step_refuses_the_global_aux_loss_over_several_replicas_before_any_collective():
    """RL replicas run as many micro-batches as they were dealt: a per-micro-batch all-reduce over them would hang."""
    from services.common.config import RLConfig
    from services.trainer.parallel.groups import Axis, single_process
    from services.trainer.rl.step import rl_step

    cfg = tiny_config()
    cfg.model.aux_loss_type = "global"
    two = dict(dp=Axis("dp", None, (0, 1), 0), world=Axis("world", None, (0, 1), 0))
    optimizer = type("Optimizer", (), {"groups": dataclasses.replace(single_process(), **two)})()
    with pytest.raises(ValueError, match="aux_loss_type=global"):
        rl_step(MoETransformer(cfg.model), optimizer, [], RLConfig(), CPU, version=0)


def test_an_rl_run_with_the_global_aux_loss_over_several_replicas_is_refused_before_any_process_starts():
    from services.trainer.rl.train_rl import validate_rl

    cfg = tiny_config()
    cfg.model.aux_loss_type, cfg.rl.groups_per_step = "global", 2
    validate_rl(cfg, world_size=1)  # one replica: the step's counts are that replica's
    with pytest.raises(ConfigError, match=r"aux_loss_type=global.*2 data-parallel replicas"):
        validate_rl(cfg, world_size=2)
