"""Router: token -> top-k experts and their weights, plus the load-balancing losses.

Scores are computed in fp32 whatever the autocast dtype (small logit differences decide routing; for bf16 x on CUDA,
on the tensor cores: router_logits.py). Balancing has three
mechanisms that can be combined: the aux loss (Switch/GShard form E·Σ fᵢ·Pᵢ, per micro-batch, per sequence or global),
the z-loss (ST-MoE, keeps router logits small), and the aux-loss-free expert bias (DeepSeek-V3), which shifts
*selection* only and is updated after each optimizer step from the observed load. With a capacity factor each expert
keeps its best ceil(cf·T·k/E) slots (`capacity_mask`); with `pad_to_capacity` the routing also carries that capacity,
and the dispatchers give every expert exactly that many rows (dispatcher.py).

When one micro-batch's tokens are spread over several ranks (sequence parallel over TP, context parallel over CP), the
parallel code sets `sp_group` (fixed) and `cp_group` (bound per micro-batch). The micro-batch aux loss and the z-loss
then use the whole micro-batch's statistics: the per-expert counts and the token count are summed over those groups in
one all-reduce (no gradient flows through them), each rank adds its own tokens' share (Σ over local tokens / all
tokens), and the shares sum over the ranks to exactly the single-device loss and gradients. The per-sequence aux loss stays a
statistic of the rank's token shard.

Rows that are not tokens of the micro-batch (the RL step pads a micro-batch to split it over SP or CP ranks with a
separate document, rl/folded.py) are named by `padding`, set around that forward: they are left out of the load
(`tokens_per_expert`), of every aux statistic (counts, probabilities, the token count the ranks sum) and of the
z-loss, so the losses are those of the real tokens alone. They are still routed (and replayed) as any row, but with
a capacity factor they take no slot (`capacity_mask`): every slot they would have held goes to a real token.

The global aux loss (`aux_loss_type: global`; Qiu et al. 2025, "Demons in the Detail": balance over the global batch,
not each micro-batch) takes fᵢ over every token the step has routed so far: the counts of the micro-batch are summed
over its ranks and over the data-parallel replicas (`dp_group`, set by the parallel code), whose j-th micro-batches run
together, and added to `global_routed`, which holds the step's counts until `reset_step_statistics` (once per optimizer
step, with the bias update). Pᵢ stays this rank's tokens' term: Σ over local tokens / (the j-th micro-batches' tokens
over all replicas / replicas). The aux gradient is scaled by 1 / (micro-batches of the step over DP), so the replicas'
gradients sum to the single-device gradient of one process whose j-th micro-batch is the replicas' j-th micro-batches
together: E·Σ fᵢ·Pᵢ with Pᵢ their tokens' mean. On one rank with one micro-batch it is the micro-batch loss. It is
taken in passes with autograd on only (a no-grad pass, e.g. RL log-probs, adds nothing to the step's counts), and a
recompute in backward uses the statistics of the forward it repeats (`recompute.same_as_forward`), not the grown ones.

Nothing here makes the host wait for the device (counts are scatter-adds, the per-sequence statistics are sized by an
upper bound instead of the number of sequences). With `fused` (config `model.moe_kernels: [router]`) the plain case —
no group limit, no capacity, no replay, micro-batch or global aux loss — runs the Triton router (`kernels/router.py`),
which also returns the per-expert counts and mean probabilities the aux loss needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from services.common.config import ModelConfig
from services.trainer.model import recompute
from services.trainer.model.moe.experts import triton_applies
from services.trainer.model.moe.router_logits import router_logits


@dataclass
class Routing:
    """Where each token goes. `expert_ids`/`weights`: [T, k]; `kept`: [T, k] bool (False = dropped by capacity), or None
    when routing is dropless."""

    expert_ids: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor | None
    aux_loss: torch.Tensor  # already scaled by its coefficients (aux + z), a scalar attached to the graph
    capacity: int | None = None  # `model.pad_to_capacity`: rows every expert gets (kept slots, then padding); else None


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        # Aux-loss-free balancing state: the bias is not trained by gradients; `tokens_per_expert` accumulates the load
        # seen since the last bias update.
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.num_experts, dtype=torch.float32), persistent=False)
        # The global aux loss's step statistics: routed slots per expert, then routed tokens, over the DP replicas and
        # the step's micro-batches so far (int64: exact at any batch size). Zeroed by `reset_step_statistics`.
        self.register_buffer("global_routed", torch.zeros(cfg.num_experts + 1, dtype=torch.int64), persistent=False)
        # Set by a replay context (RL routing replay): a [T, k] tensor of expert ids to use instead of top-k.
        self.replay_ids: torch.Tensor | None = None
        self.fused = "router" in cfg.moe_kernels  # the Triton router where it applies (see the module docstring)
        # Process groups over which one micro-batch's tokens are spread (see the module docstring); empty: all here.
        self.sp_group: dist.ProcessGroup | None = None
        self.cp_group: dist.ProcessGroup | None = None
        self.dp_group: dist.ProcessGroup | None = None  # the data-parallel replicas (the global aux loss only)
        # Set around a padded micro-batch's forward (rl/folded.py): [T] bool, True at the rows that are padding, which
        # the load and the losses leave out (see the module docstring); None: every row is a token.
        self.padding: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, segment_ids: torch.Tensor | None = None) -> Routing:
        cfg = self.cfg
        logits = router_logits(x, self.weight)  # [T, E] fp32
        if self.fused and self._fused_applies(logits):
            return self._forward_fused(logits)
        scores = torch.softmax(logits, dim=-1) if cfg.score_func == "softmax" else torch.sigmoid(logits)
        expert_ids = self.replay_ids if self.replay_ids is not None else self._select(scores.detach())
        weights = scores.gather(1, expert_ids)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        weights = weights * cfg.routed_scaling_factor
        kept = capacity_mask(scores.detach(), expert_ids, cfg.capacity_factor, self.padding)
        real = None if self.padding is None else ~self.padding[:, None]  # [T, 1]: the rows that are tokens
        routed = expert_counts(expert_ids, self.num_experts, real)  # the tokens' slots per expert, dropped ones too
        counted = kept if real is None or kept is None else kept & real  # the load: the tokens' kept slots
        self._count_load(routed if kept is None else expert_counts(expert_ids, self.num_experts, counted))
        aux, tokens = logits.new_zeros(()), None  # tokens: the micro-batch's token count, once a loss needs it
        if self._aux_applies():
            probs = scores if cfg.score_func == "softmax" else scores / scores.sum(-1, keepdim=True).clamp_min(1e-20)
            if real is not None:
                probs = probs * real
            if cfg.aux_loss_type == "sequence" and segment_ids is not None:
                aux = aux + cfg.aux_loss_coeff * load_balancing_loss(probs, expert_ids, self.num_experts, segment_ids,
                                                                     real)
            else:
                aux, tokens = self._balance_loss(routed, probs.sum(0), logits)
        capacity = None
        if cfg.pad_to_capacity and kept is not None:
            capacity = expert_capacity(logits.shape[0], self.top_k, self.num_experts, cfg.capacity_factor)
        return Routing(expert_ids, weights, kept, self._with_z_loss(aux, logits, tokens), capacity)

    def _aux_applies(self) -> bool:
        cfg = self.cfg
        # A global aux loss only in passes that train: a no-grad pass must not add to the step's statistics.
        wanted = cfg.aux_loss_type != "global" or torch.is_grad_enabled()
        return cfg.aux_loss_coeff > 0 and cfg.aux_loss_type != "none" and self.training and wanted

    def _balance_loss(self, counts: torch.Tensor, prob_sum: torch.Tensor, logits: torch.Tensor):
        """(this rank's share of coeff·E·Σ fᵢ·Pᵢ, the micro-batch's token count or None): `counts` are the local
        routed slots per expert, `prob_sum` the local tokens' summed probabilities (with gradient). Micro-batch: f and
        the token count of the whole micro-batch; global: f of the step so far and the tokens per replica (module
        docstring)."""
        scale = self.cfg.aux_loss_coeff * self.num_experts
        if self.cfg.aux_loss_type == "global":
            f, tokens_per_replica = recompute.same_as_forward(self, lambda: self._global_stats(counts, logits))
            return scale * (f * prob_sum / tokens_per_replica).sum(), None  # (the z-loss counts its micro-batch)
        counts, tokens = self._micro_batch_stats(counts, logits)
        f = counts / (tokens * self.top_k)
        return scale * (f * prob_sum / tokens).sum(), tokens

    @torch.no_grad()
    def _global_stats(self, counts: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds this micro-batch's routing, summed over its ranks and the DP replicas (one all-reduce per group, on the
        device), to the step's statistics. Returns (f of the step so far, the micro-batch's tokens per replica)."""
        stats = torch.cat([counts.detach().long(), self._local_tokens(logits, torch.long)])
        for group in (*self._token_groups(), self.dp_group):
            if group is not None:
                dist.all_reduce(stats, group=group)
        self.global_routed += stats
        f = self.global_routed[:-1].float() / (self.global_routed[-1].float() * self.top_k)
        replicas = dist.get_world_size(self.dp_group) if self.dp_group is not None else 1
        return f, stats[-1].float() / replicas

    @torch.no_grad()
    def reset_step_statistics(self) -> None:
        """Forget the step's global aux statistics: once per optimizer step (train.advance_router_bias)."""
        self.global_routed.zero_()

    def _token_groups(self) -> list:
        # cp_group is bound per micro-batch: a recompute in backward (another micro-batch's may be bound by then, 1F1B)
        # sums over the group its forward summed over
        cp_group = recompute.same_as_forward((self, "cp_group"), lambda: self.cp_group)
        return [g for g in (self.sp_group, cp_group) if g is not None]

    def _local_tokens(self, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[1]: this rank's tokens of the micro-batch, its rows less the padding ones (counted on the device)."""
        if self.padding is None:
            return logits.new_full((1,), logits.shape[0], dtype=dtype)
        return (~self.padding).sum(dtype=dtype).reshape(1)

    def _micro_batch_stats(self, counts: torch.Tensor | None, logits: torch.Tensor):
        """(per-expert routed slots, tokens) of the whole micro-batch, without gradient. On one rank without padding:
        the local counts and token count (a Python number: nothing to allocate); else the token count is counted on
        the device and, spread over ranks, both are summed in one all-reduce."""
        groups = self._token_groups()
        if not groups and self.padding is None:
            return (None if counts is None else counts.float()), float(logits.shape[0])
        local = self._local_tokens(logits, logits.dtype)
        stats = local if counts is None else torch.cat([counts.detach().float(), local])
        for group in groups:
            dist.all_reduce(stats, group=group)
        return (None if counts is None else stats[:-1]), stats[-1]

    def _fused_applies(self, logits: torch.Tensor) -> bool:
        cfg = self.cfg
        return (triton_applies(logits) and not cfg.num_groups and cfg.capacity_factor <= 0
                and self.replay_ids is None and self.padding is None and cfg.aux_loss_type != "sequence")

    def _forward_fused(self, logits: torch.Tensor) -> Routing:
        from kernels.router import router as fused_router

        cfg = self.cfg
        out = fused_router(logits, self.top_k, cfg.score_func, self.expert_bias, cfg.norm_topk_prob,
                           cfg.routed_scaling_factor)
        self._count_load(out.tokens_per_expert)
        aux, tokens = logits.new_zeros(()), None
        if self._aux_applies():  # from the kernel's statistics: the counts, and the mean probabilities times T
            aux, tokens = self._balance_loss(out.tokens_per_expert, out.mean_probs * logits.shape[0], logits)
        return Routing(out.indices, out.weights, None, self._with_z_loss(aux, logits, tokens))

    def _with_z_loss(self, aux: torch.Tensor, logits: torch.Tensor, tokens) -> torch.Tensor:
        """`tokens`: the micro-batch's token count over the ranks holding it, if the aux loss already summed it (else
        None); this rank adds its tokens' share of the z-loss."""
        if self.cfg.z_loss_coeff > 0 and self.training:
            if tokens is None:
                tokens = self._micro_batch_stats(None, logits)[1]
            return aux + self.cfg.z_loss_coeff * z_loss(logits, self.padding) * (logits.shape[0] / tokens)
        return aux

    @torch.no_grad()
    def _count_load(self, counts: torch.Tensor) -> None:
        """Accumulate the load the bias update reads; once per real forward (not again when recomputed in backward)."""
        if not recompute.in_recompute():
            self.tokens_per_expert += counts.float()

    def _select(self, scores: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        choice = scores + self.expert_bias  # the bias steers selection only; weights come from the unbiased scores
        if cfg.num_groups:
            choice = limit_to_top_groups(choice, cfg.num_groups, cfg.topk_groups)
        return choice.topk(self.top_k, dim=-1, sorted=False).indices

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor, rate: float) -> None:
        """Aux-loss-free step: raise the bias of under-loaded experts, lower it for over-loaded ones."""
        error = tokens_per_expert.mean() - tokens_per_expert
        self.expert_bias += rate * torch.sign(error)


def expert_counts(expert_ids: torch.Tensor, num_experts: int, kept: torch.Tensor | None = None) -> torch.Tensor:
    """[num_experts] int64: how many (kept) slots chose each expert; `kept` [T, k] or [T, 1] (whole rows). A
    scatter-add, unlike `bincount`, whose CUDA kernel reads the largest id back to the host to size its output."""
    ones = torch.ones_like(expert_ids) if kept is None else kept.to(expert_ids.dtype).expand_as(expert_ids)
    counts = torch.zeros(num_experts, dtype=expert_ids.dtype, device=expert_ids.device)
    return counts.scatter_add_(0, expert_ids.reshape(-1), ones.reshape(-1))


def limit_to_top_groups(scores: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """Group-limited routing (DeepSeek-V3): rank groups by the sum of their two best scores, mask all but the best groups."""
    T, E = scores.shape
    grouped = scores.view(T, num_groups, E // num_groups)
    group_score = grouped.topk(min(2, E // num_groups), dim=-1).values.sum(-1)  # [T, G]
    top_groups = group_score.topk(topk_groups, dim=-1).indices
    group_mask = torch.zeros(T, num_groups, dtype=torch.bool, device=scores.device).scatter_(1, top_groups, True)
    return grouped.masked_fill(~group_mask[:, :, None], float("-inf")).view(T, E)


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots each expert keeps of `num_tokens` tokens' top-k: ceil(cf·T·k/E), at least 1. A host number (T is a
    shape): what pad-to-capacity sizes every expert's rows with."""
    return max(1, int(-(-capacity_factor * num_tokens * top_k // num_experts)))


def capacity_mask(scores: torch.Tensor, expert_ids: torch.Tensor, capacity_factor: float,
                  padding: torch.Tensor | None = None) -> torch.Tensor | None:
    """[T, k] bool: which (token, slot) assignments survive an expert capacity of ceil(cf·T·k/E); None when dropless.

    Each expert keeps its highest-scoring tokens among those routed to it — by top-k or by replayed ids alike, so a
    replayed forward drops what a forward that chose the same ids with the same scores drops. `padding` ([T] bool,
    `Router.padding`): rows that take no slot, so they never displace a token; T still counts them, which keeps the
    capacity a host number (pad-to-capacity sizes rows with it) equal on the SP/CP ranks of one micro-batch.
    """
    T, k = expert_ids.shape
    if capacity_factor <= 0:
        return None
    E = scores.shape[1]
    capacity = expert_capacity(T, k, E, capacity_factor)
    routed = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, expert_ids, True)  # [T, E]
    if padding is not None:
        routed &= ~padding[:, None]
    ranked = scores.masked_fill(~routed, float("-inf"))
    keep_tokens = ranked.topk(min(capacity, T), dim=0).indices  # [cap, E] best tokens per expert
    keep = torch.zeros_like(routed).scatter_(0, keep_tokens, True) & routed
    return keep.gather(1, expert_ids)


def load_balancing_loss(probs: torch.Tensor, expert_ids: torch.Tensor, num_experts: int,
                        segment_ids: torch.Tensor | None = None, real: torch.Tensor | None = None) -> torch.Tensor:
    """E·Σₑ fₑ·Pₑ, fₑ = share of routed slots that chose e, Pₑ = mean router probability of e.

    With `segment_ids` the statistic is taken per sequence and averaged over sequences (DeepSeek-V3's sequence-wise loss),
    otherwise over the whole micro-batch. `real` ([T, 1] bool, with `segment_ids`): the rows that are tokens; the others
    (padding, their `probs` zeroed by the caller) count in no sequence.
    """
    T, k = expert_ids.shape
    if segment_ids is None:
        f = expert_counts(expert_ids, num_experts).to(probs.dtype) / (T * k)
        return num_experts * (f * probs.mean(0)).sum()
    # Segment ids are < T (each segment has a token), so T rows hold every segment without asking the device for the
    # count; rows of ids no token has are left out of the mean.
    flat = segment_ids[:, None] * num_experts + expert_ids
    counts = expert_counts(flat, T * num_experts, real).view(T, num_experts).to(probs.dtype)
    ones = probs.new_ones(T) if real is None else real[:, 0].to(probs.dtype)
    tokens = torch.zeros(T, device=probs.device, dtype=probs.dtype).index_add_(0, segment_ids, ones)
    present = tokens > 0
    f = counts / (tokens.clamp_min(1)[:, None] * k)
    p = torch.zeros(T, num_experts, device=probs.device, dtype=probs.dtype).index_add_(0, segment_ids, probs)
    p = p / tokens.clamp_min(1)[:, None]
    per_segment = num_experts * (f * p).sum(-1)
    return torch.where(present, per_segment, 0.0).sum() / present.sum().clamp_min(1)  # none: a shard of padding


def z_loss(logits: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over the rows of logsumexp(logits)², a `padding` row ([T] bool) adding 0 (the caller scales by the rows'
    share of the micro-batch's tokens)."""
    lse2 = torch.logsumexp(logits, dim=-1).square()
    return (lse2 if padding is None else lse2.masked_fill(padding, 0.0)).mean()
