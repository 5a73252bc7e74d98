"""The PPO-clip loss against hand-computed values: the numbers below are worked out on paper."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.rl.losses import k3, ppo_clip_loss


def test_ppo_clip_against_the_rollout_keeps_the_pessimistic_term_per_token():
    logp = torch.full((4,), math.log(0.5), requires_grad=True)
    rollout = torch.log(torch.tensor([0.25, 0.5, 1.0, 0.25]))  # ratios 2, 1, 0.5, 2
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    out = ppo_clip_loss(logp, rollout, adv, clip_low=0.2, clip_high=0.2)
    # per token: -min(2, 1.2) = -1.2 | -1 | -min(-0.5, -0.8) = 0.8 | -min(-2, -1.2) = 2
    assert float(out.loss_sum.detach()) == pytest.approx(0.6, abs=1e-5)
    assert out.clipped == 2 and out.tokens == 4
    out.loss_sum.backward()
    # d(-ratio·A)/dlogp = -ratio·A where the unclipped term is kept, 0 where the clip holds it.
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -1.0, 0.0, 2.0]))
    assert out.mismatch_abs_sum == pytest.approx(math.log(2) + 0 + math.log(2) + math.log(2), abs=1e-5)


def test_asymmetric_clip_bounds_apply_to_their_own_side():
    logp = torch.zeros(2)
    rollout = torch.log(torch.tensor([1 / 1.25, 1 / 0.75]))  # ratios 1.25 and 0.75
    out = ppo_clip_loss(logp, rollout, torch.tensor([1.0, -1.0]), clip_low=0.2, clip_high=0.28)
    # 1.25 < 1 + 0.28: not clipped; 0.75 < 1 - 0.2 with A < 0: clipped to 0.8
    assert out.clipped == 1
    assert float(out.loss_sum.detach()) == pytest.approx(-1.25 + 0.8, abs=1e-5)


def test_truncated_importance_weights_correct_for_the_rollout_policy():
    old = torch.full((3,), math.log(0.5))
    logp = old.clone().requires_grad_(True)
    rollout = torch.log(torch.tensor([0.1, 0.5, 1.0]))  # pi_old / pi_rollout = 5 (capped to 2), 1, 0.5
    out = ppo_clip_loss(logp, rollout, torch.ones(3), 0.2, 0.2, old_logp=old, tis_cap=2.0)
    assert float(out.loss_sum.detach()) == pytest.approx(-(2 + 1 + 0.5), abs=1e-5)
    assert out.tis_weight_sum == pytest.approx(3.5, abs=1e-5) and out.clipped == 0
    out.loss_sum.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-2.0, -1.0, -0.5]))
    assert out.mismatch_abs_sum == pytest.approx(math.log(5) + math.log(2), abs=1e-5)
    assert out.mismatch_kl_sum == pytest.approx(float(k3(torch.log(torch.tensor([5.0, 1.0, 0.5]))).sum()), abs=1e-5)


def test_k3_kl_to_the_reference_is_added_per_token_and_pulls_towards_it():
    logp = torch.zeros(2, requires_grad=True)
    ref = torch.full((2,), math.log(2.0))
    out = ppo_clip_loss(logp, logp.detach(), torch.zeros(2), 0.2, 0.2, ref_logp=ref, kl_coef=0.5)
    per_token_kl = 2 - math.log(2) - 1
    assert out.kl_sum == pytest.approx(2 * per_token_kl, abs=1e-5)
    assert float(out.loss_sum.detach()) == pytest.approx(0.5 * 2 * per_token_kl, abs=1e-5)
    out.loss_sum.backward()
    assert bool((logp.grad < 0).all())  # descending raises logp towards the more likely reference


def test_k3_is_zero_only_where_the_policies_agree():
    assert float(k3(torch.tensor(0.0))) == 0.0
    assert float(k3(torch.tensor(0.3))) > 0 and float(k3(torch.tensor(-0.3))) > 0
