"""One RL optimizer step on a batch of trajectory groups, with MoE routing replay.

Each sample is fed as prompt + completion minus its last token, packed with others into micro-batches (document-masked
like pre-training); the log-prob of completion token j is read at position len(prompt) - 1 + j. While the policy
log-probs are computed, every router's `replay_ids` is set to the experts the rollout chose for those very tokens, so the
trainer evaluates the same sparse network that generated the sample: without replay, a tiny weight or precision
difference flips top-k choices and the importance ratios of MoE models blow up (routing replay, as in GSPO/R3).

Over several trainer ranks the step is data parallel (see `rl_step`): each replica runs its share of the step's groups
and the distributed optimizer of pre-training sums the gradients, with the loss normalised by the whole step's tokens.
On folded layouts (TP with sequence parallelism, EP, ETP; not PP or CP) the replicas are the attention layout's DP
axis and the policy forward is `folded.py`'s (vocab-parallel log-probs, replayed ids cut to each SP shard, fillers that
keep an EP group's forwards paired).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from services.common.config import RLConfig
from services.trainer.model.loss import IGNORE_INDEX
from services.trainer.parallel.groups import Axis
from services.trainer.rl.folded import folded_token_logprobs, needs_folded_forward, step_layout, with_fillers
from services.trainer.rl.losses import group_advantages, ppo_clip_loss
from services.trainer.rl.rollouts import RolloutGroup
from services.trainer.rl.shared import share


@dataclass
class RLMicroBatch:
    tokens: torch.Tensor  # [T] fed tokens
    position_ids: torch.Tensor  # [T]
    cu_seqlens: torch.Tensor  # [S+1] int32
    targets: torch.Tensor  # [T] next token where it is a completion token, else IGNORE_INDEX
    rollout_logp: torch.Tensor  # [T] (0 where targets is ignored)
    advantages: torch.Tensor  # [T]
    routing: torch.Tensor  # [moe layers, T, top_k]

    @property
    def response(self) -> torch.Tensor:
        return self.targets != IGNORE_INDEX

    def to(self, device: torch.device) -> "RLMicroBatch":
        return RLMicroBatch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def pack(groups: list[RolloutGroup], advantages: torch.Tensor, max_tokens: int) -> list[RLMicroBatch]:
    """Samples in order into micro-batches of at most `max_tokens` fed tokens (a longer sample gets one of its own)."""
    out, current, used = [], [], 0
    for g, group in enumerate(groups):
        for i, s in enumerate(group.samples):
            n = len(s.prompt_tokens) + len(s.tokens) - 1
            if current and used + n > max_tokens:
                out.append(_collate(current))
                current, used = [], 0
            current.append((s, float(advantages[g, i])))
            used += n
    if current:
        out.append(_collate(current))
    return out


def _collate(items) -> RLMicroBatch:
    tokens, pos, targets, rollout, adv, routing, lens = [], [], [], [], [], [], []
    for s, a in items:
        seq = s.prompt_tokens + s.tokens
        n, P = len(seq) - 1, len(s.prompt_tokens)
        tokens.append(torch.tensor(seq[:-1]))
        pos.append(torch.arange(n))
        t = torch.full((n,), IGNORE_INDEX)
        t[P - 1:] = torch.tensor(s.tokens)
        targets.append(t)
        r = torch.zeros(n)
        r[P - 1:] = s.logprobs
        rollout.append(r)
        adv.append(torch.full((n,), a))
        routing.append(s.routing)
        lens.append(n)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return RLMicroBatch(torch.cat(tokens), torch.cat(pos), cu, torch.cat(targets), torch.cat(rollout), torch.cat(adv),
                        torch.cat(routing, dim=1))


@contextmanager
def routing_replay(model: nn.Module, routing: torch.Tensor):
    """Make every MoE layer use the recorded expert ids [moe layers, T, k] (in `model.moe_layers()` order)."""
    layers = model.moe_layers()
    if routing.shape[0] != len(layers):
        raise ValueError(f"recorded routing covers {routing.shape[0]} MoE layers, the model has {len(layers)}")
    try:
        for layer, ids in zip(layers, routing):
            layer.router.replay_ids = ids
        yield
    finally:
        for layer in layers:
            layer.router.replay_ids = None


def token_logprobs(model: nn.Module, mb: RLMicroBatch, temperature: float,
                   autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """log pi(target) at every position [T] fp32 (garbage where the target is ignored), under replayed routing and the
    rollout's sampling temperature. Under TP (vocab-parallel logits, sequence parallel) and for EP fillers:
    `folded.folded_token_logprobs`."""
    if needs_folded_forward(model, mb):
        return folded_token_logprobs(model, mb, temperature, autocast_dtype)
    device = mb.tokens.device
    with routing_replay(model, mb.routing), torch.autocast(device.type, dtype=autocast_dtype,
                                                          enabled=autocast_dtype is not None):
        logits = model(mb.tokens, mb.position_ids, mb.cu_seqlens)
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, mb.targets.clamp_min(0)[:, None]).squeeze(1)


def rl_step(model: nn.Module, optimizer: Any, groups: list[RolloutGroup], cfg: RLConfig, device: torch.device,
            clip_grad: float = 1.0, ref_model: nn.Module | None = None, autocast_dtype: torch.dtype | None = None,
            version: int | None = None, lr: float | None = None) -> dict[str, Any]:
    """Forward/backward over all groups, then one optimizer step; returns the step's metrics. `version` is the
    version of the trainer's weights before this step (for the staleness metric).

    Data parallel: when `optimizer` is the DistributedOptimizer of a layout (`folded.check_layout`), `groups` is the
    whole step (the same list on every rank, `shared.py`) and this rank runs forward/backward on its DP `share`. The
    step's response-token count is all-reduced before any backward, so every rank divides its token-loss sums by the same
    global count; the optimizer sums the gradients over the replicas, clips by the global norm (its `clip_grad`) and
    steps with `lr`; the token sums behind the metrics are all-reduced. The result equals one process running every
    group (tests/test_rl_parallel.py). The MoE aux loss, if the model is in training mode, is a per-micro-batch term
    here as in one process (each micro-batch adds its own): it matches one process when the micro-batches do."""
    if getattr(model.cfg, "capacity_factor", 0) > 0:
        raise ValueError("routing replay needs a dropless MoE (model.capacity_factor=0): capacity drops depend on the "
                         "batch, so replayed and rollout computations would differ")
    temps = {g.temperature for g in groups}
    if len(temps) != 1:
        raise ValueError(f"groups sampled at different temperatures {sorted(temps)} cannot share a step")
    temperature = temps.pop()
    layout = step_layout(optimizer)  # folded layouts: see folded.py
    dp, distributed = layout.dp, layout.world.size > 1
    rewards = torch.tensor([[s.reward for s in g.samples] for g in groups], dtype=torch.float32)
    advantages = group_advantages(rewards, cfg.std_normalize)  # per group: a share's rows are its groups' rows
    mine = share(range(len(groups)), dp.rank, dp.size)
    packed = pack([groups[i] for i in mine], advantages[mine], cfg.micro_batch_tokens)
    # counted on the host, before the copy: no device-to-host sync per micro-batch
    local_tokens = torch.tensor([float(sum(int(mb.response.sum()) for mb in packed))], dtype=torch.float64,
                                device=device)
    micro_batches = with_fillers([mb.to(device) for mb in packed], model, layout, device)  # EP pairs forwards
    step_tokens = int(_sum_over(local_tokens, dp)[0])

    old, ref = [None] * len(micro_batches), [None] * len(micro_batches)
    with torch.no_grad():
        if cfg.recompute_logprobs:
            old = [token_logprobs(model, mb, temperature, autocast_dtype) for mb in micro_batches]
        if ref_model is not None and cfg.kl_coef > 0:
            ref = [token_logprobs(ref_model, mb, temperature, autocast_dtype) for mb in micro_batches]

    if distributed:
        optimizer.zero_grad()
        optimizer.begin_step(len(micro_batches))  # gradient reductions launch as the last backward completes buckets
    else:
        optimizer.zero_grad(set_to_none=True)
    names = ("loss", "clipped", "kl_sum", "mismatch_abs_sum", "mismatch_kl_sum", "tis_weight_sum")
    sums = torch.zeros(len(names), dtype=torch.float64)
    for mb, old_lp, ref_lp in zip(micro_batches, old, ref):
        m = mb.response
        logp = token_logprobs(model, mb, temperature, autocast_dtype)
        terms = ppo_clip_loss(logp[m], mb.rollout_logp[m], mb.advantages[m], cfg.clip_eps_low, cfg.clip_eps_high,
                              old_logp=None if old_lp is None else old_lp[m], tis_cap=cfg.tis_cap,
                              ref_logp=None if ref_lp is None else ref_lp[m], kl_coef=cfg.kl_coef)
        (terms.loss_sum / max(step_tokens, 1)).backward()
        sums += torch.tensor([float(terms.loss_sum.detach()), *(getattr(terms, k) for k in names[1:])],
                             dtype=torch.float64)
    totals = dict(zip(names, _sum_over(sums.to(device), dp).tolist()))
    if distributed:
        if lr is None:
            raise ValueError("a data-parallel RL step needs `lr` (the DistributedOptimizer takes it at each step)")
        grad_norm = optimizer.step(lr)  # sums the replicas' gradients, clips by the global norm
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
        optimizer.step()
    lengths = [len(s.tokens) for g in groups for s in g.samples]
    per_token = max(step_tokens, 1)
    return {
        "loss": totals["loss"] / per_token, "grad_norm": float(grad_norm), "reward": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "response_length": sum(lengths) / len(lengths), "response_tokens": step_tokens,
        "clip_frac": totals["clipped"] / per_token, "kl": totals["kl_sum"] / per_token,
        "logprob_mismatch": totals["mismatch_abs_sum"] / per_token,
        "rollout_kl": totals["mismatch_kl_sum"] / per_token,
        "tis_weight": totals["tis_weight_sum"] / per_token,
        "policy_versions": sorted({g.version for g in groups}),
        "staleness_max": max(version - g.version for g in groups) if version is not None else None,
    }


def _sum_over(t: torch.Tensor, axis: Axis) -> torch.Tensor:
    if axis.size > 1:
        dist.all_reduce(t, group=axis.group)
    return t.cpu()
