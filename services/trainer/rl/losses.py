"""RL policy-gradient losses over response tokens: the PPO-clip objective (the GRPO advantages it weighs tokens by are
computed per group by the dataloader: services/dataloader/rollout_source.py).

Three policies meet here. pi_rollout generated the tokens (its log-probs come with the trajectories, computed by the
rollout engine, possibly from weights a few versions old and in another precision). pi_old is the trainer's own
evaluation of the weights at the start of the step (optional: `old_logp`). pi_theta is being optimised.

- Without `old_logp`, the PPO ratio is taken directly against the rollout: r = pi_theta / pi_rollout.
- With `old_logp` (decoupled PPO), the ratio is r = pi_theta / pi_old, and the train/rollout mismatch (staleness,
  kernels, precision) is corrected by a truncated importance weight w = min(pi_old / pi_rollout, tis_cap), detached.
- Optional KL to a reference policy, k3 estimator (Schulman): exp(ref - logp) - (ref - logp) - 1, unbiased and >= 0.

Aggregation is token-level: the caller divides the returned sum by the response tokens of the whole step, so long and
short responses weigh per token and the gradient does not depend on how samples were split into micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PolicyLoss:
    """The summed loss (with grad) and its metric sums, which stay on the loss's device (no host sync per micro-batch:
    read `stats` once per step; the float properties sync, for tests and one-off use)."""

    STATS = ("clipped", "kl_sum", "mismatch_abs_sum", "mismatch_kl_sum", "tis_weight_sum")

    loss_sum: torch.Tensor  # Σ per-token loss (with grad); divide by the step's response tokens
    tokens: int
    # float64 [5], in STATS order: tokens whose gradient the clip removed; Σ k3 KL to the reference (0 without one);
    # Σ |log pi_train - log pi_rollout| (pi_train = pi_old when given, else pi_theta); Σ k3 estimate of
    # KL(pi_rollout || pi_train) over the rollout's own samples; Σ truncated importance weights (tokens when not used)
    stats: torch.Tensor

    def _stat(self, name: str) -> float:
        return float(self.stats[self.STATS.index(name)])

    clipped = property(lambda self: self._stat("clipped"))
    kl_sum = property(lambda self: self._stat("kl_sum"))
    mismatch_abs_sum = property(lambda self: self._stat("mismatch_abs_sum"))
    mismatch_kl_sum = property(lambda self: self._stat("mismatch_kl_sum"))
    tis_weight_sum = property(lambda self: self._stat("tis_weight_sum"))


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(q || p) from samples of q, given log(p/q) at those samples."""
    return torch.exp(log_ratio) - log_ratio - 1


def ppo_clip_loss(logp: torch.Tensor, rollout_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                  clip_high: float, old_logp: torch.Tensor | None = None, tis_cap: float = 0.0,
                  ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0) -> PolicyLoss:
    """All inputs are flat over response tokens [N]; only `logp` carries a gradient."""
    rollout_logp = rollout_logp.detach().float()
    logp = logp.float()
    base = rollout_logp if old_logp is None else old_logp.detach().float()
    ratio = torch.exp(logp - base)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    weight = torch.ones_like(per_token)
    if old_logp is not None and tis_cap > 0:
        weight = torch.exp(base - rollout_logp).clamp(max=tis_cap)
        per_token = per_token * weight
    kl = torch.zeros_like(per_token)
    if ref_logp is not None and kl_coef > 0:
        kl = k3(ref_logp.detach().float() - logp)
        per_token = per_token + kl_coef * kl
    loss_sum = per_token.sum()
    with torch.no_grad():
        train = base if old_logp is not None else logp.detach()
        was_clipped = ((advantages > 0) & (ratio > 1 + clip_high)) | ((advantages < 0) & (ratio < 1 - clip_low))
        stats = torch.stack([was_clipped.sum(), kl.detach().sum(), (train - rollout_logp).abs().sum(),
                             k3(train - rollout_logp).sum(), weight.sum()]).double()
        return PolicyLoss(loss_sum=loss_sum, tokens=logp.numel(), stats=stats)
