"""The RL step on a folded layout: which layouts it runs; the policy forward under TP (sequence parallel), EP/ETP, PP,
CP.

What changes against one process, and why:
- **Data parallel axis** is the attention layout's DP (`groups.dp`): TP peers hold the same groups (the same share);
  EP/ETP do not split data (experts are sharded, tokens are dispatched to them). Token counts and metric sums are
  all-reduced over DP; gradients are reduced by the DistributedOptimizer as in pre-training (dense over DP×CP, experts
  over EDP), which also clips by the global norm.
- **Log-probs under TP** come from the vocab-parallel output layer: each rank holds logits of its vocabulary slice and
  `vocab_parallel_token_logprobs` all-reduces three [T] vectors; full-vocabulary logits never exist.
- **Sequence parallelism** (required for MoE under TP) splits each micro-batch's tokens over TP, so a micro-batch is
  padded to a multiple of tp with a separate padding document (it attends to nothing real, its log-probs are dropped)
  and the replayed expert ids are cut to each rank's token shard, as the MoE layer's input is. The padding tokens pass
  through the routers, which are told their rows (`Router.padding`, cut to the rank's shard as well) and leave them
  out of the load (`tokens_per_expert`: the bias update sees real tokens only), of the micro-batch aux statistics
  all-reduced over the SP/CP ranks and of the z-loss: those losses are one process's.
- **EP/ETP with routing replay**: replayed ids are global expert ids, exactly what the router's top-k produces, so the
  EP dispatchers route them unchanged to the ranks holding those experts.
- **Equal forward counts**: when an EP group spans different DP replicas, its all-to-alls pair the ranks' forwards, so
  every rank must run as many micro-batches as the busiest one; the others add *filler* micro-batches (one token per SP
  rank, no response token, aux loss off, load restored), whose gradient is exactly zero.
- **EP overlap** (`parallel.ep_overlap`): every pass's micro-batches, fillers included, go in pairs whose forwards
  take turns layer by layer (rl/pipelined.py, as pre-training's parallel/micro_batch_pairs.py): the policy loss's, and
  forward only, the old and reference log-probs' (the reference, `frozen_copy`, binds its own modules); the state a
  policy forward sets on the modules is rebound at every switch (`PolicyBinding`).
- **Pipeline parallelism** runs the policy forward of each micro-batch through the pre-training schedules
  (rl/pipelined.py): forward-only passes for the old and reference log-probs, which stay on the last stage, then 1F1B
  with the policy loss as the last stage's loss. Each stage's MoE layers replay the recorded rows of their own layer ids
  (rl/replay.py); fillers carry routing for every MoE layer of the whole model, as the rollout records it. The loss
  sums exist on the last stage only and are summed over the pp group, so every rank reports the same metrics. The
  reference model is `frozen_copy` of the stage: the same layers, the same (shared) process groups.

- **Context parallelism**: each micro-batch runs on the CP group of its size, every per-token tensor cut by the
  tokens' zigzag index (rl/cp_sharding.py, padded to 2·c·sp equal chunks for a group of c ranks), so log-probs, losses
  and metric sums are per rank and summed over DP×CP; `policy_forward` binds the cut's layout to the attention cores
  (fillers and micro-batches of CP size 1 run unbound: local attention over their own tokens, the routers' statistics
  local too). Static CP (`parallel.cp`) cuts every micro-batch over the whole group. Dynamic CP
  (`parallel.cp_sizes`): the dataloader's RL source sizes each micro-batch by the pre-training budget, and the CP
  blocks of a dp rank split its micro-batches as in pre-training (context_parallel.py `cp_share`: a micro-batch sized
  c < cp runs on one aligned block of c ranks; the ones left over after equal shares on the whole group), so the CP
  ranks of a dp rank run equally many passes and the EP fillers above still pair every rank's forwards.
  A micro-batch of a size the trainer's `parallel.cp_sizes` lacks (a dataloader run with other ones) is refused by
  `ParallelGroups.cp_of`, naming the key.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from services.trainer.model.loss import IGNORE_INDEX
from services.trainer.parallel.context_parallel import bind_layout, is_context_parallel
from services.trainer.parallel.differentiable import group_size, local_token_shard
from services.trainer.parallel.groups import ParallelGroups, ep_spans_replicas, single_process
from services.trainer.parallel.tensor_parallel import VocabParallelCrossEntropy, vocab_parallel_token_logprobs
from services.trainer.rl.replay import owned_routing, recorded_moe_layers


def step_layout(optimizer: Any) -> ParallelGroups:
    """The layout the step runs on: the DistributedOptimizer's groups, else one process. Every folded layout runs (what
    an RL run cannot, `train_rl.validate_rl` refuses before any process starts)."""
    groups = getattr(optimizer, "groups", None)
    if not isinstance(groups, ParallelGroups) or groups.world.size == 1:
        return single_process()
    return groups


def process_group_memo(groups: ParallelGroups | None) -> dict[int, Any]:
    """A `copy.deepcopy` memo that keeps process groups shared: a parallelized model (hooks, dispatchers and routers
    hold groups) can then be copied, e.g. into the frozen reference policy."""
    if groups is None:
        return {}
    axes = [getattr(groups, f) for f in ("tp", "cp", "dp", "dp_cp", "pp", "etp", "ep", "edp", "ep_etp", "world")]
    axes += list(groups.cp_by_size.values())
    return {id(a.group): a.group for a in axes if a.group is not None}


def frozen_copy(model: nn.Module, groups: ParallelGroups | None = None) -> nn.Module:
    ref = copy.deepcopy(model, process_group_memo(groups)).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


# ---------------------------------------------------------------- equal forward counts across an EP group


def with_fillers(micro_batches: list, model: nn.Module, groups: ParallelGroups, device: torch.device) -> list:
    """`micro_batches` plus fillers up to the largest count over the world, when EP pairs different replicas."""
    if groups.world.size == 1 or not ep_spans_replicas(groups.layout):
        return micro_batches
    count = torch.tensor([len(micro_batches)], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=groups.world.group)
    return micro_batches + [_filler(model, device) for _ in range(int(count) - len(micro_batches))]


def _filler(model: nn.Module, device: torch.device):
    from services.trainer.rl.step import RLMicroBatch

    n = max(sp_size(model), 1)
    k, layers = model.cfg.top_k, recorded_moe_layers(model.cfg)  # as recorded: every MoE layer of the whole model
    mb = RLMicroBatch(tokens=torch.zeros(n, dtype=torch.int64, device=device),
                      position_ids=torch.arange(n, device=device),
                      cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device=device),
                      targets=torch.full((n,), IGNORE_INDEX, dtype=torch.int64, device=device),
                      rollout_logp=torch.zeros(n, device=device), advantages=torch.zeros(n, device=device),
                      routing=torch.arange(k, device=device).expand(layers, n, k).clone(),
                      rewards=torch.zeros(n, device=device),
                      versions=torch.full((n,), -1, dtype=torch.int32, device=device), max_seqlen=n)
    mb.is_filler = True
    return mb


# ---------------------------------------------------------------- the policy forward


def sp_size(model: nn.Module) -> int:
    group = getattr(model, "tensor_parallel_group", None)
    return group_size(group) if getattr(model, "sequence_parallel", False) else 1


def needs_folded_forward(model: nn.Module, mb: Any) -> bool:
    """Whether `mb` runs through `folded_token_logprobs`: under TP, for fillers, and on a context-parallel model even
    uncut (CP size 1), whose attention cores and routers must be unbound from the previous micro-batch's layout."""
    return (getattr(model, "tensor_parallel_group", None) is not None or getattr(mb, "is_filler", False)
            or mb.cp_layout is not None or is_context_parallel(model))


def _padded(mb, pad: int):
    """(tokens, position_ids, cu_seqlens, routing) with `pad` padding tokens as one more document at the end."""
    if pad == 0:
        return mb.tokens, mb.position_ids, mb.cu_seqlens, mb.routing
    dev = mb.tokens.device
    tokens = torch.cat([mb.tokens, mb.tokens.new_zeros(pad)])
    pos = torch.cat([mb.position_ids, torch.arange(pad, device=dev, dtype=mb.position_ids.dtype)])
    cu = torch.cat([mb.cu_seqlens, mb.cu_seqlens[-1:] + pad])
    L, _, k = mb.routing.shape
    filler_ids = torch.arange(k, device=dev, dtype=mb.routing.dtype).expand(L, pad, k)
    return tokens, pos, cu, torch.cat([mb.routing, filler_ids], dim=1)


@dataclass
class PolicyInput:
    """One RL micro-batch as the policy forward feeds it to this rank's model (whole, or a pipeline stage): padded with
    a separate document to a multiple of the sequence-parallel size, the replayed ids cut to this rank's token shard."""

    mb: Any  # the RLMicroBatch (targets, response mask)
    tokens: torch.Tensor  # [T + pad]
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    routing: torch.Tensor  # [MoE layers of the whole model, (T + pad) / sp, k]
    padding: torch.Tensor | None  # [(T + pad) / sp] bool: which of those rows are padding tokens (None: none)
    filler: bool
    max_seqlen: int | None  # the longest document, padding included (None: the attention reads it on the device)
    cp_layout: Any  # the micro-batch's CP layout (rl/cp_sharding.py), None when not cut


def policy_input(model: nn.Module, mb: Any) -> PolicyInput:
    """`mb` (an RLMicroBatch or a filler) for this rank's model: `PolicyInput`'s padding and token shard."""
    group = getattr(model, "tensor_parallel_group", None)
    sp = sp_size(model)
    T = mb.tokens.shape[0]
    pad = (-T) % sp
    tokens, pos, cu, routing = _padded(mb, pad)
    padding = _padding_rows(mb, pad)
    if sp > 1:  # the MoE layers see this rank's token shard: so do the replayed ids and the padding rows
        routing = torch.stack([local_token_shard(ids, group) for ids in routing])
        padding = None if padding is None else local_token_shard(padding, group)
    max_seqlen = None if mb.max_seqlen is None else max(mb.max_seqlen, pad)
    return PolicyInput(mb, tokens, pos, cu, routing, padding, getattr(mb, "is_filler", False), max_seqlen,
                       mb.cp_layout)


def _padding_rows(mb: Any, pad: int) -> torch.Tensor | None:
    """[T + pad] bool: the padding tokens of `mb` padded by `pad`, those the CP cut added (`mb.padding`) and the `pad`
    sequence-parallel ones at the end; None when there are none."""
    if mb.padding is None and pad == 0:
        return None
    T = mb.tokens.shape[0]
    rows = torch.zeros(T + pad, dtype=torch.bool, device=mb.tokens.device)
    rows[T:] = True
    if mb.padding is not None:
        rows[mb.padding] = True
    return rows


@contextmanager
def policy_forward(model: nn.Module, p: PolicyInput, autocast_dtype: torch.dtype | None):
    """What the model's forward of `p` (whole, or a pipeline chunk) runs under: its `PolicyBinding` (replayed routing,
    padding kept out of the routers' load and losses, a filler's load restored and losses off, the attention cores
    bound to its CP layout; none: local attention) and autocast."""
    binding = PolicyBinding(model, [p])
    binding.bind(0)
    try:
        with torch.autocast(p.tokens.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            yield
    finally:
        binding.release()


class PolicyBinding:
    """The per-micro-batch state a policy forward sets on the modules, for one forward (`policy_forward`) or for
    forwards that take turns (`parallel.ep_overlap`: a pair's policy forwards interleaved layer by layer,
    rl/pipelined.py): `bind(i)` before every resumption of input i's forward sets its replayed ids, padding rows (which
    the routers leave out of the load and their aux and z losses, model/moe/router.py `Router.padding`), aux scale (0
    for a filler) and CP layout on the modules; `release()` after the forward or the pair clears them. A filler's load is snapshotted when it is bound and restored at the next `bind`/`release`, i.e. right
    after each of its segments: the load the other micro-batch counts between its segments stays."""

    def __init__(self, model: nn.Module, inputs: list[PolicyInput]):
        self.model, self.inputs, self.layers = model, inputs, model.moe_layers()
        self.scales = [m.aux_loss_scale for m in self.layers]
        self.routing = [owned_routing(model, p.routing) for p in inputs]
        self.load: list[torch.Tensor] | None = None  # the load before a filler's segment

    def bind(self, i: int) -> None:
        self._restore_load()
        p = self.inputs[i]
        for m, ids, scale in zip(self.layers, self.routing[i], self.scales, strict=True):
            m.router.replay_ids, m.router.padding = ids, p.padding
            m.aux_loss_scale = 0.0 if p.filler else scale
        if p.filler:
            self.load = [m.router.tokens_per_expert.clone() for m in self.layers]
        bind_layout(self.model, p.cp_layout, p.tokens.device)  # nothing to bind without context parallelism

    def release(self) -> None:
        self._restore_load()
        for m, scale in zip(self.layers, self.scales):
            m.router.replay_ids, m.router.padding, m.aux_loss_scale = None, None, scale

    def _restore_load(self) -> None:
        if self.load is not None:
            for m, load in zip(self.layers, self.load):
                m.router.tokens_per_expert.copy_(load)
            self.load = None


def logits_to_logprobs(model: nn.Module, logits: torch.Tensor, p: PolicyInput, temperature: float) -> torch.Tensor:
    """log pi(target) [T] fp32 from the output layer's logits of `p` (this rank's vocabulary slice under TP)."""
    logits = logits[:p.mb.tokens.shape[0]].float()
    if temperature > 0:
        logits = logits / temperature
    labels = p.mb.targets.clamp_min(0)
    if isinstance(model.loss_fn, VocabParallelCrossEntropy):
        return vocab_parallel_token_logprobs(logits, labels, model.loss_fn)
    return torch.log_softmax(logits, dim=-1).gather(1, labels[:, None]).squeeze(1)


def folded_token_logprobs(model: nn.Module, mb: Any, temperature: float,
                          autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`step.token_logprobs` on a TP (sequence-parallel) model or for a filler micro-batch: [T] fp32 on each TP rank."""
    p = policy_input(model, mb)
    with policy_forward(model, p, autocast_dtype):
        logits = model(p.tokens, p.position_ids, p.cu_seqlens, p.max_seqlen)
    return logits_to_logprobs(model, logits, p, temperature)
