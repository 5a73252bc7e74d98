"""An RL micro-batch cut for context parallelism: every per-token tensor by the zigzag index of pre-training's CP.

Pre-training's `context_parallel.shard_micro_batch` cuts tokens, labels and position ids; an RL micro-batch carries
more per-token tensors (targets, rollout log-probs, advantages, rewards, versions, and the replayed expert ids, token
dim 1 of [MoE layers, T, k]), and every one of them is cut by the same index as the tokens, so each CP rank's policy
loss reads the log-prob, advantage and rollout log-prob of the very tokens it ran. The old and reference log-probs are
computed on the cut micro-batch and are cut the same way by construction.

RL micro-batches are packed without padding (the dataloader's RL source), so their length rarely splits into 2·cp
equal chunks: a micro-batch is first padded, with one separate padding document at its end (it attends only to
itself; its targets are ignored), to a multiple of 2·cp·sp (sp: the sequence-parallel size, so that each rank's cut
also splits evenly over TP; rl/folded.py then adds no padding of its own). The padding tokens' positions among the
rank's tokens travel with the cut (`RLMicroBatch.padding`) so that the routers leave them out, as they do the
sequence-parallel padding (rl/folded.py `PolicyBinding`): out of the routed load, of the micro-batch aux
statistics (counts, probabilities and the token count summed over the ranks) and of the z-loss.

Token sums stay exact: each token lives on one CP rank, so the loss and metric sums are summed over DP×CP (rl/step.py)
and the gradients over DP×CP (dense) and EDP (experts) by the distributed optimizer, as in pre-training.
"""

from __future__ import annotations

import dataclasses

import torch

from services.trainer.model.attention import document_ids, longest_document
from services.trainer.model.loss import IGNORE_INDEX
from services.trainer.parallel.context_parallel import CPComm, CPLayout, local_cu_seqlens, zigzag_index
from services.trainer.parallel.groups import Axis

# [T] tensors of an RLMicroBatch and the value a padding token gets; `routing` ([layers, T, k]) is cut on dim 1
PER_TOKEN_PADDING = {"tokens": 0, "targets": IGNORE_INDEX, "rollout_logp": 0.0, "advantages": 0.0, "rewards": 0.0,
                     "versions": -1}


def cp_shard(mb, cp: Axis, comm: CPComm, sp: int = 1):
    """This rank's zigzag share of `mb` (an RLMicroBatch on the host, whole) over the CP axis `cp`: the same micro-batch
    when cp has one rank."""
    if cp.size == 1:
        return mb
    T = mb.tokens.shape[0]
    mb = _padded(mb, (-T) % (2 * cp.size * sp))
    total = mb.tokens.shape[0]
    doc_ids = document_ids(mb.cu_seqlens, total)
    index = zigzag_index(total, cp.size, cp.rank)
    cu = local_cu_seqlens(doc_ids, index)
    cut = {name: getattr(mb, name)[index] for name in (*PER_TOKEN_PADDING, "position_ids")}
    padding = (index >= T).nonzero().flatten() if total > T else None  # on the host: no device wait
    return dataclasses.replace(mb, **cut, routing=mb.routing[:, index], cu_seqlens=cu, max_seqlen=longest_document(cu),
                               padding=padding, cp_layout=CPLayout(cp.group, cp.rank, cp.size, doc_ids, comm))


def _padded(mb, pad: int):
    """`mb` with `pad` padding tokens appended as one more document."""
    if pad == 0:
        return mb
    ext = {name: torch.cat([getattr(mb, name), getattr(mb, name).new_full((pad,), value)])
           for name, value in PER_TOKEN_PADDING.items()}
    ext["position_ids"] = torch.cat([mb.position_ids, torch.arange(pad, dtype=mb.position_ids.dtype)])
    L, _, k = mb.routing.shape
    ext["routing"] = torch.cat([mb.routing, torch.arange(k, dtype=mb.routing.dtype).expand(L, pad, k)], dim=1)
    ext["cu_seqlens"] = torch.cat([mb.cu_seqlens, mb.cu_seqlens[-1:] + pad])
    return dataclasses.replace(mb, **ext)
