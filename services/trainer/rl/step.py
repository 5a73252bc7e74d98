"""One RL optimizer step on the micro-batches the dataloader packed from trajectory groups, with MoE routing replay.

The micro-batches come from the dataloader's rollout source (services/dataloader/rollout_source.py documents their
tensors): each sample is one document, prompt + completion minus its last token, with the completion tokens as the
actions (`loss_mask`), their rollout log-probs, the sample's GRPO advantage (computed per group by the dataloader),
reward and policy version, and the experts the rollout chose. While the policy log-probs are computed, every router's
`replay_ids` is set to those experts, so the trainer evaluates the same sparse network that generated the sample:
without replay, a tiny weight or precision difference flips top-k choices and the importance ratios of MoE models blow
up (routing replay, as in GSPO/R3).

Over several trainer ranks the step is data parallel (see `rl_step`): each replica runs the micro-batches the dataloader
dealt it and the distributed optimizer of pre-training sums the gradients, with the loss normalised by the whole step's
tokens.
On folded layouts (TP with sequence parallelism, EP, ETP, PP, static and dynamic CP) the replicas are the attention
layout's DP axis and the policy forward is `folded.py`'s (vocab-parallel log-probs, replayed ids cut to each SP shard,
fillers that keep an EP group's forwards paired); with pipeline stages it runs through the pipeline schedules and the
policy loss in the last stage (`pipelined.py`). Under CP each rank runs its zigzag cut of every micro-batch of its CP
block's share, over the CP group of the micro-batch's size (static CP: every micro-batch over the whole group), every
per-token tensor cut alike (`cp_sharding.py`), and the loss sums are summed over DP×CP.

With a capacity factor (`model.capacity_factor` > 0, with or without `pad_to_capacity`) the routers drop slots of the
replayed ids as they drop their own top-k's: each expert keeps the highest-scoring ceil(cf·T·k/E) of the (token,
slot) pairs replaying it, T the rows of the forward (model/moe/router.py `capacity_mask`; under SP, CP or EP, this
rank's rows, as in pre-training; padding rows take no slot). That depends on the weights and the micro-batch alone, so
the old-log-prob and policy-loss passes of a micro-batch drop the same slots and the first ratio is exactly 1. The
rollout engine generates dropless (its decode batches are not the trainer's micro-batches: services/rl_rollout/
worker.py), so the train/rollout log-prob mismatch metrics (`logprob_mismatch`, `rollout_kl`) include what the drops
change, and the decoupled ratio (`rl.recompute_logprobs`, `rl.tis_cap`) corrects for it as for any mismatch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from services.common.config import RLConfig
from services.trainer.metrics import StepValues
from services.trainer.model.attention import longest_document
from services.trainer.model.loss import IGNORE_INDEX
from services.trainer.model.moe.experts import fp8_weights_held
from services.trainer.optim import clip_and_step
from services.trainer.parallel.groups import ParallelGroups, ep_spans_replicas, sum_over
from services.trainer.parallel.context_parallel import CPComm, cp_share
from services.trainer.parallel.micro_batch_pairs import backward_passes
from services.trainer.rl.cp_sharding import cp_shard
from services.trainer.rl.folded import folded_token_logprobs, needs_folded_forward, sp_size, step_layout, with_fillers
from services.trainer.rl.losses import PolicyLoss, ppo_clip_loss
from services.trainer.rl.pipelined import pipeline_logprobs, pipeline_policy_backward
from services.trainer.rl.replay import routing_replay


# RL micro-batches are packed trajectories of any length (and EP fillers of one token): EP peers of different replicas
# route different token counts, so their capacities differ, which the padded all-to-all cannot size on the host
PAD_TO_CAPACITY_ACROSS_REPLICAS = (
    "`model.pad_to_capacity` sizes the expert-parallel all-to-all from this rank's capacity, assuming every EP peer "
    "routes as many tokens; here EP groups (`parallel.ep`/`etp`) span data-parallel replicas, whose RL micro-batches "
    "(packed trajectories) differ in length; drop pad_to_capacity (the capacity factor alone runs), or keep each "
    "EP×ETP group inside one replica's TP×CP ranks")


@dataclass
class RLMicroBatch:
    tokens: torch.Tensor  # [T] fed tokens
    position_ids: torch.Tensor  # [T]
    cu_seqlens: torch.Tensor  # [S+1] int32, one segment per sample
    targets: torch.Tensor  # [T] next token where it is a completion token, else IGNORE_INDEX
    rollout_logp: torch.Tensor  # [T] (0 where targets is ignored)
    advantages: torch.Tensor  # [T]
    routing: torch.Tensor  # [moe layers, T, top_k]
    rewards: torch.Tensor  # [T] the sample's reward on its completion tokens
    versions: torch.Tensor  # [T] int32, the policy version that generated the sample on its completion tokens, else -1
    # The longest sample, a host number for the attention kernels (None: they read it from the device, a host sync)
    max_seqlen: int | None = None
    # Under context parallelism (rl/cp_sharding.py): the positions of the tokens added to cut the micro-batch into
    # equal chunks (int64, None: none), and the layout the attention cores exchange keys and values by
    padding: torch.Tensor | None = None
    cp_layout: Any = None

    @classmethod
    def from_data(cls, mb: dict[str, torch.Tensor]) -> "RLMicroBatch":
        """From one micro-batch dict of the dataloader's RL source (host tensors)."""
        mask, cu = mb["loss_mask"], mb["cu_seqlens"]
        return cls(mb["tokens"], mb["position_ids"], cu,
                   torch.where(mask, mb["labels"], torch.full_like(mb["labels"], IGNORE_INDEX)),
                   mb["rollout_logprobs"], mb["advantages"], mb["routing_ids"].permute(1, 0, 2).long(),
                   mb["rewards"], mb["versions"], longest_document(cu))

    @property
    def response(self) -> torch.Tensor:
        return self.targets != IGNORE_INDEX

    def to(self, device: torch.device) -> "RLMicroBatch":
        return dataclasses.replace(self, **{f.name: v.to(device) for f in dataclasses.fields(self)
                                            if isinstance(v := getattr(self, f.name), torch.Tensor)})


def step_sums(micro_batches: list[RLMicroBatch], version: int, max_staleness: int) -> torch.Tensor:
    """This rank's float64 sums behind the step's data metrics: [response tokens, samples, Σ reward, Σ reward²,
    Σ response length, samples outside the staleness bound, then the samples of version `version - j` for
    j = 0..max_staleness]."""
    sums = torch.zeros(6 + max_staleness + 1, dtype=torch.float64)
    for mb in micro_batches:
        m = mb.response
        lengths = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).long()
        sample = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[m]  # the sample of each action
        actions = torch.bincount(sample, minlength=len(lengths))
        first = torch.searchsorted(sample, torch.arange(len(lengths))[actions > 0])  # each sample's first action
        rewards, stale = mb.rewards[m][first].double(), version - mb.versions[m][first].long()
        inside = (stale >= 0) & (stale <= max_staleness)
        sums[0] += float(m.sum())
        sums[1] += len(rewards)
        sums[2] += float(rewards.sum())
        sums[3] += float((rewards * rewards).sum())
        sums[4] += float(actions.sum())
        sums[5] += float((~inside).sum())
        sums[6:] += torch.bincount(stale[inside], minlength=max_staleness + 1).double()
    return sums


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
        logits = model(mb.tokens, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, mb.targets.clamp_min(0)[:, None]).squeeze(1)


def rl_step(model: nn.Module, optimizer: Any, data: list[dict[str, torch.Tensor]], cfg: RLConfig,
            device: torch.device, clip_grad: float = 1.0, ref_model: nn.Module | None = None,
            autocast_dtype: torch.dtype | None = None, *, version: int, lr: float | None = None,
            cp_comm: CPComm = "allgather", ep_overlap: bool = False) -> "RLStepMetrics":
    """Forward/backward over this rank's micro-batches of the step (`data`, the dataloader client's `next_step`), then
    one optimizer step, queued; returns the step's metrics (`RLStepMetrics.read()`, which waits for the step's work).
    `version` is the version of the trainer's weights before this step, i.e. the step index: every sample must be
    within `cfg.max_staleness` versions of it (`step_sums`).

    Data parallel: when `optimizer` is the DistributedOptimizer of a layout (`folded.step_layout`), `data` is this
    rank's share of the step (the dataloader deals whole samples to the dp ranks; the TP ranks of a replica get the
    same). The step's response-token count and the sums behind the data metrics are all-reduced over dp before any
    backward, so every rank divides its token-loss sums by the same global count; the optimizer sums the gradients
    over the replicas, clips by the global norm (its `clip_grad`) and steps with `lr`; the token sums behind the loss
    metrics are all-reduced (over pp too: with pipeline stages they are computed on the last one). Under context
    parallelism the CP ranks of a replica receive the same `data`; each runs its zigzag cut of every micro-batch of its
    CP block's share over the CP group of the micro-batch's `cp_size` (`_cp_local`; `cp_comm`: `parallel.cp_comm`),
    the loss sums are all-reduced over DP×CP and the dense gradients summed there. With `ep_overlap`
    (`parallel.ep_overlap`) the policy-loss micro-batches (fillers included) go in pairs as in pre-training, each pair's
    forwards interleaved so one's expert all-to-alls travel while the other computes, one backward per pair
    (rl/pipelined.py); the old and reference log-prob passes go in the same pairs, forward only.
    The result equals one process running every rank's micro-batches (tests/test_rl_parallel.py, test_rl_folded.py,
    test_rl_pipeline.py, test_rl_cp.py).
    The MoE aux loss, if the model is in training mode, is a per-micro-batch term here as in one process (each
    micro-batch adds its own); the global one (`model.aux_loss_type=global`) runs on one replica only (its counts are
    reset with the bias update, train_rl.py), not over several."""
    layout = step_layout(optimizer)  # folded layouts: see folded.py
    dp, distributed = layout.dp, layout.world.size > 1
    temperature = _step_temperature(model, data, layout)
    packed = [RLMicroBatch.from_data(mb) for mb in data]
    data_sums = _global_data_sums(packed, version, cfg.max_staleness, dp, device)  # whole: CP peers hold the same
    local = _cp_local(data, layout, cp_comm, sp_size(model))  # this CP rank's tokens of each micro-batch it runs
    micro_batches = with_fillers([mb.to(device) for mb in local], model, layout, device)  # EP pairs forwards
    step_tokens = int(data_sums[0])

    # the policy's weights are fixed until the optimizer step: its FP8 experts quantise them once for every pass
    forwards = len(micro_batches) * (2 if cfg.recompute_logprobs else 1)
    with fp8_weights_held(model, forwards):
        old, ref = [None] * len(micro_batches), [None] * len(micro_batches)
        with torch.no_grad():
            if cfg.recompute_logprobs:
                old = _all_logprobs(model, micro_batches, temperature, autocast_dtype, layout, ep_overlap)
            if ref_model is not None and cfg.kl_coef > 0:
                ref = _all_logprobs(ref_model, micro_batches, temperature, autocast_dtype, layout, ep_overlap)

        if distributed:
            optimizer.zero_grad()
            # reductions launch as the last backward completes buckets: one backward per pair under ep_overlap
            optimizer.begin_step(backward_passes(len(micro_batches)) if ep_overlap else len(micro_batches))
        else:
            optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(len(_LOSS_SUMS), dtype=torch.float64, device=device)  # on the device: read with the metrics

        def policy_loss(i: int, logp: torch.Tensor) -> torch.Tensor:
            """Micro-batch i's summed policy loss from its per-token log-probs; its metric sums go into `sums`."""
            mb, old_lp, ref_lp = micro_batches[i], old[i], ref[i]
            m = mb.response
            terms = ppo_clip_loss(logp[m], mb.rollout_logp[m], mb.advantages[m], cfg.clip_eps_low, cfg.clip_eps_high,
                                  old_logp=None if old_lp is None else old_lp[m], tis_cap=cfg.tis_cap,
                                  ref_logp=None if ref_lp is None else ref_lp[m], kl_coef=cfg.kl_coef)
            sums.add_(_loss_sums(terms))
            return terms.loss_sum

        if layout.pp.size > 1 or ep_overlap:  # the loss in the pipeline's last stage; pairs (rl/pipelined.py)
            pipeline_policy_backward(model, micro_batches, policy_loss, step_tokens, temperature, autocast_dtype,
                                     layout, pairs=ep_overlap)
        else:
            for i, mb in enumerate(micro_batches):
                logp = token_logprobs(model, mb, temperature, autocast_dtype)
                (policy_loss(i, logp) / max(step_tokens, 1)).backward()
    # the loss sums live on the last pipeline stage (zeros on the others), on each of its TP ranks alike, each CP rank
    # holding those of its own tokens
    sum_over(sums, layout.pp, layout.dp_cp)
    if distributed:
        if lr is None:
            raise ValueError("a data-parallel RL step needs `lr` (the DistributedOptimizer takes it at each step)")
        grad_norm = optimizer.step(lr)  # sums the replicas' gradients, clips by the global norm
    else:
        grad_norm = clip_and_step(optimizer, model.parameters(), clip_grad)
    return RLStepMetrics(_data_metrics(data_sums, version, cfg.max_staleness), step_tokens, sums, grad_norm)


def _cp_local(data: list[dict[str, torch.Tensor]], layout: ParallelGroups, cp_comm: CPComm, sp: int
              ) -> list[RLMicroBatch]:
    """The micro-batches this rank runs, each its cut over the CP group of the micro-batch's size, as pre-training's
    `forward_backward_parallel`: `cp_share` picks this CP block's share of the dp rank's micro-batches (dynamic CP:
    a micro-batch sized c < cp runs on one aligned block of c ranks; static: all of them, on the whole group), and
    `cp_shard` cuts each over `layout.cp_of(cp_size)` (no `cp_size`: the whole group)."""
    out = []
    for mb in cp_share(data, layout.cp.size, layout.cp.rank):
        axis = layout.cp_of(int(mb["cp_size"])) if "cp_size" in mb else layout.cp
        out.append(cp_shard(RLMicroBatch.from_data(mb), axis, cp_comm, sp))
    return out


def _step_temperature(model: nn.Module, data: list[dict[str, torch.Tensor]], layout: ParallelGroups) -> float:
    """The sampling temperature the step's micro-batches share, after refusing what the layout cannot run (as
    `train_rl.validate_rl` does before any process starts)."""
    model_cfg = getattr(model, "cfg", None)
    replicas = layout.dp.size
    if getattr(model_cfg, "pad_to_capacity", False) and ep_spans_replicas(layout.layout):
        raise ValueError(PAD_TO_CAPACITY_ACROSS_REPLICAS)
    if replicas > 1 and getattr(model_cfg, "aux_loss_type", "") == "global" and model_cfg.aux_loss_coeff > 0:
        raise ValueError(f"`model.aux_loss_type=global` sums expert counts over the {replicas} data-parallel replicas "
                         "micro-batch by micro-batch, but RL replicas run as many micro-batches as they were dealt "
                         "(a collective would wait forever); use aux_loss_type=micro_batch (or none) for RL")
    temps = {float(mb["temperature"]) for mb in data}
    if len(temps) > 1:
        raise ValueError(f"micro-batches sampled at different temperatures {sorted(temps)} cannot share a step")
    return temps.pop() if temps else 1.0


def _global_data_sums(packed: list[RLMicroBatch], version: int, max_staleness: int, dp, device: torch.device
                      ) -> torch.Tensor:
    """`step_sums` over every replica's share of the step, on the host. Counted on the host, before the copy: no
    device-to-host sync per micro-batch. Over several replicas the sums are read back at once: the staleness check must
    refuse the step before it trains, and the per-token divisor and the data metrics come from them. In the RL loop
    this read (and `with_fillers`' count) finds the device idle: the previous step's weights were just published from
    the host (train_rl.py)."""
    data_sums = step_sums(packed, version, max_staleness)
    if dp.size > 1:
        data_sums = sum_over(data_sums.to(device), dp).cpu()
    if data_sums[5] > 0:  # on every rank at once: the sums are global
        raise ValueError(f"the dataloader served {int(data_sums[5])} samples of policy versions outside "
                         f"[{version - max_staleness}, {version}] for step {version} (rl.max_staleness="
                         f"{max_staleness}): it filters by the step it builds, so the trainer and the dataloader "
                         "disagree on the step; resume both from the same checkpoint")
    return data_sums


def _data_metrics(data_sums: torch.Tensor, version: int, max_staleness: int) -> dict[str, Any]:
    """The step's data figures from its global sums (`step_sums`' layout): reward mean and spread, response length,
    which policy versions generated the samples and the oldest one's staleness."""
    samples = max(int(data_sums[1]), 1)
    reward_mean = float(data_sums[2]) / samples
    reward_var = (float(data_sums[3]) - samples * reward_mean ** 2) / (samples - 1) if samples > 1 else 0.0
    versions = [version - j for j in range(max_staleness + 1) if data_sums[6 + j] > 0]
    return {"reward": reward_mean, "reward_std": max(reward_var, 0.0) ** 0.5, "samples": int(data_sums[1]),
            "response_length": float(data_sums[4]) / samples, "response_tokens": int(data_sums[0]),
            "policy_versions": sorted(versions), "staleness_max": version - min(versions) if versions else 0}


_LOSS_SUMS = ("loss", *PolicyLoss.STATS)


class RLStepMetrics:
    """One RL step's metrics; `read()` gives them as numbers. The data figures (reward, lengths, versions) were summed
    on the host before the step was queued; the loss sums and the gradient norm are the step's results on the device,
    copied to the host as it is queued (`StepValues`), so `read()` waits for this step's work and nothing queued after
    it: the RL loop reads a step's metrics once it has queued the next step's work."""

    def __init__(self, data: dict[str, Any], step_tokens: int, sums: torch.Tensor, grad_norm: torch.Tensor):
        self.data, self.step_tokens = data, step_tokens
        self.values = StepValues(sums=sums, grad_norm=torch.as_tensor(grad_norm))

    def read(self) -> dict[str, Any]:
        v = self.values.read()
        per_token = max(self.step_tokens, 1)
        mean = {k: total / per_token for k, total in zip(_LOSS_SUMS, v["sums"].tolist())}  # per response token
        return {"loss": mean["loss"], "grad_norm": float(v["grad_norm"]), **self.data, "clip_frac": mean["clipped"],
                "kl": mean["kl_sum"], "logprob_mismatch": mean["mismatch_abs_sum"],
                "rollout_kl": mean["mismatch_kl_sum"], "tis_weight": mean["tis_weight_sum"]}


def _loss_sums(terms: PolicyLoss) -> torch.Tensor:
    return torch.cat([terms.loss_sum.detach().double()[None], terms.stats])


def _all_logprobs(model: nn.Module, micro_batches: list[RLMicroBatch], temperature: float,
                  autocast_dtype: torch.dtype | None, layout: ParallelGroups, pairs: bool) -> list[torch.Tensor | None]:
    """`token_logprobs` of every micro-batch; through the pipeline when pp > 1 (then on its last stage only) or in
    pairs (`parallel.ep_overlap`: the policy-loss pass's pairs, forward only)."""
    if layout.pp.size > 1 or pairs:
        return pipeline_logprobs(model, micro_batches, temperature, autocast_dtype, layout, pairs)
    return [token_logprobs(model, mb, temperature, autocast_dtype) for mb in micro_batches]
