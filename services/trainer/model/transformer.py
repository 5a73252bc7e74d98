"""The decoder: embedding -> [RMSNorm -> attention -> RMSNorm -> MLP or MoE] x L -> RMSNorm -> output layer, and in
training optionally multi-token prediction depths after it (mtp.py).

Attention is GQA (attention.py) or Multi-head Latent Attention (mla.py), by `model.attention`.

Written as a single-device model; parallelism is applied to it from `services/trainer/parallel/` (layers are replaced by
their parallel counterparts, the dispatcher by an expert-parallel one), so this file stays readable on its own.

The residual stream travels between blocks as two terms, `x + branch` (the last sublayer's output not yet added), so
that every residual add happens together with the RMSNorm that reads its sum (`residual_norm`): under `model.compile`
the pair is one fused kernel forward and one backward.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from services.common.config import ModelConfig
from kernels.cross_entropy import linear_cross_entropy_sum
from services.trainer.model.attention import Attention, document_ids
from services.trainer.model.initial_weights import initial_state
from services.trainer.model.mla import MLAttention
from services.trainer.model.loss import IGNORE_INDEX, cross_entropy_sum
from services.trainer.model.mlp import SwiGLUMLP
from services.trainer.model.moe.moe_layer import MoELayer
from services.trainer.model.mtp import MTPLayer, MTPLossSums, future_labels
from services.trainer.model.stages import Stages, run_to_end


def add_rms_norm(x: torch.Tensor, branch: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the RMSNorm of its sum: (x + branch, rms_norm(x + branch) * weight). Memory-bound: eager,
    an add and a norm forward, and backward the norm's two kernels plus autograd's sum of the two gradients that reach
    x + branch; compiled, one kernel each way."""
    x = x + branch
    return x, F.rms_norm(x, (x.shape[-1],), weight, eps)


@functools.cache
def compiled_add_rms_norm():
    """`add_rms_norm` through torch.compile, built once per process and shared by every norm (the weight is an argument,
    not a guarded module attribute); new token counts re-trace once, then a shape-generic version serves them all.
    Grad mode, autocast and the branch's dtype each select a version too: a bf16 training step holds four (attention
    and dense MLP outputs arrive in bf16, MoE outputs in fp32), evaluation under no_grad adds two. Past dynamo's
    `recompile_limit` (8) a new combination would run eagerly, with a warning."""
    return torch.compile(add_rms_norm)


def _forward_replaced(module: nn.Module) -> bool:
    """A memory policy (services/trainer/model/recompute.py) replaced this module's forward on the instance."""
    return "forward" in vars(module)


def residual_norm(norm: nn.RMSNorm, x: torch.Tensor, branch: torch.Tensor | None,
                  compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream `x + branch` (x alone when branch is None) and `norm` of it, fused under `compiled`.

    A norm whose forward a memory policy replaced (recompute "norm") runs through that forward, eagerly, so that its
    output is still recomputed and discarded from its consumers. Skipping the norm module's own call skips its forward
    pre-hooks; the only ones (the distributed optimizer's waits for parameter all-gathers) are also on its parent, which
    waits for its children's parameters too.
    """
    if branch is None:
        return x, norm(x)
    if compiled and not _forward_replaced(norm):
        return compiled_add_rms_norm()(x, branch, norm.weight, norm.eps)
    x = x + branch
    return x, norm(x)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = MLAttention(cfg) if cfg.attention == "mla" else Attention(cfg)  # same signature
        self.mlp_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.is_moe = layer_id >= cfg.first_k_dense
        self.mlp = MoELayer(cfg) if self.is_moe else SwiGLUMLP(cfg.hidden_size, cfg.ffn_hidden_size, fp8=cfg.fp8)
        self.compiled_norms = cfg.compile  # residual adds + norms through `compiled_add_rms_norm`

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                segment_ids: torch.Tensor, max_seqlen: int | None = None, staged: bool = False,
                branch: torch.Tensor | None = None):
        """Residual stream `x + branch` (x alone when branch is None) -> the same two terms after this block: the
        stream after attention and the MLP's output. With `staged`, a generator that pauses while the MoE layer's
        all-to-alls are in flight (services/trainer/model/stages.py) and returns that pair."""
        stages = self._stages(x, branch, position_ids, cu_seqlens, segment_ids, max_seqlen, staged)
        return stages if staged else run_to_end(stages)

    def _stages(self, x, branch, position_ids, cu_seqlens, segment_ids, max_seqlen,
                staged: bool) -> Stages[tuple[torch.Tensor, torch.Tensor]]:
        x, h = residual_norm(self.attn_norm, x, branch, self.compiled_norms)
        attn_out = self.attn(h, position_ids, cu_seqlens, max_seqlen)
        x, h = residual_norm(self.mlp_norm, x, attn_out, self.compiled_norms)
        if not self.is_moe:
            return x, self.mlp(h)
        # Unstaged, the MoE layer is called plainly: a memory policy may have wrapped its forward (recompute/offload).
        return x, ((yield from self.mlp(h, segment_ids, staged=True)) if staged else self.mlp(h, segment_ids))


class MoETransformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.num_layers)})
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # untied from the embedding
        # Multi-token prediction depths (mtp.py), each a block past the main model's layers; training only.
        self.mtp = nn.ModuleList([MTPLayer(cfg, Block(cfg, cfg.num_layers + k))
                                  for k in range(cfg.mtp_num_layers)]) if cfg.mtp_num_layers else None
        self.mtp_loss_sums = MTPLossSums(cfg.mtp_num_layers)  # the step record's mtp_loss (metrics)
        # Σ token losses from (logits, labels); tensor parallelism swaps in the vocab-parallel version.
        self.loss_fn = cross_entropy_sum
        # Output layer and loss as one chunked op that never holds [T, vocab] logits (`model.moe_kernels:
        # [cross_entropy]`), called as (x, output weight, labels); tensor parallelism swaps in the vocab-parallel one.
        self.fused_loss = linear_cross_entropy_sum if "cross_entropy" in cfg.moe_kernels else None

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init from `seed`, independent of device and of how the model is later sharded: the values of
        initial_weights.py's `SeededInit`, which a parallel rank reads only its own slices of."""
        initial_state(self, seed)
        for m in self.modules():
            if isinstance(m, MoELayer):
                m.router.expert_bias.zero_()

    def moe_layers(self) -> list[MoELayer]:
        """The MoE layers this model (or pipeline stage) holds: the decoder blocks' in layer order, then the
        multi-token prediction depths'. Read off the blocks, not by walking every module: called per micro-batch."""
        blocks = [*self.layers.values(), *(depth.block for depth in self.mtp or ())]
        return [b.mlp for b in blocks if isinstance(b.mlp, MoELayer)]

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int | None = None, hidden: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, staged: bool = False, layers: range | None = None,
                mtp_labels: torch.Tensor | None = None):
        """Packed micro-batch [T] -> logits [T, vocab]; with `labels` [T], the summed token loss (fp32 scalar) instead.
        `mtp_labels` [D, T]: the MTP depths' shifted labels (`mtp.future_labels`), where the micro-batch was sharded
        (context parallelism); else they are shifted from `labels` here.

        A pipeline stage holds only some of the modules and runs them a chunk at a time: `layers` (ids; None: every
        layer it holds) starts from `hidden` (the previous chunk's output) when given, else from the embedding, and
        returns its hidden states instead of logits (ignoring `labels`) when it ends before the model's last layer or
        the stage has no `output`.
        With `staged`, a generator that pauses while MoE all-to-alls are in flight and returns that output
        (services/trainer/model/stages.py; used to interleave two micro-batches, `parallel.ep_overlap`).
        """
        stages = self._stages(tokens, position_ids, cu_seqlens, max_seqlen, hidden, labels, staged, layers, mtp_labels)
        return stages if staged else run_to_end(stages)

    def _stages(self, tokens, position_ids, cu_seqlens, max_seqlen, hidden, labels, staged: bool,
                layers: range | None, mtp_labels: torch.Tensor | None) -> Stages[torch.Tensor]:
        segment_ids = document_ids(cu_seqlens, tokens.shape[0])
        depths, branch = self.cfg.mtp_num_layers, None
        # Under pipeline parallelism the embedding (first stage) and the MTP depths (last) live apart: the depths'
        # input embeddings are taken on the first stage and travel with the stream, [T, (1 + D) h] (mtp.py).
        carry = depths > 0 and (self.embed is None or self.mtp is None)
        if labels is not None and mtp_labels is None and (self.mtp is not None or (carry and hidden is None)):
            mtp_labels = future_labels(labels, segment_ids, depths)
        if hidden is not None:
            x, *mtp_embedded = hidden.split(self.cfg.hidden_size, dim=-1) if carry else (hidden,)
        elif depths and labels is not None:
            # The tokens and the depths' input tokens t_{i+k} in one lookup, [T, 1 + D] ids: one dense embedding
            # gradient instead of 1 + D summed (the vocabulary-sized add is the cost), and under sequence parallelism one
            # reduce-scatter along the tokens.
            ids = torch.stack([tokens, *(inputs.clamp(min=0) for inputs in (labels, *mtp_labels[:-1]))], dim=1)
            x, *mtp_embedded = self.embed(ids).unbind(1)
            x = x.contiguous()  # the stream as the blocks (and their compiled kernels) always see it
        else:  # (without labels, a forward that computes no loss, the carried depths' inputs are zeros)
            x = self.embed(tokens)
            mtp_embedded = [torch.zeros_like(x)] * depths if carry else []
        mtp_embedded = mtp_embedded or None
        blocks = self.layers.values() if layers is None else [self.layers[str(i)] for i in layers]
        for block in blocks:
            if branch is not None and _forward_replaced(block):
                # Recomputed or offloaded as a whole, a block keeps its inputs: one tensor, as without the split stream.
                x, branch = x + branch, None
            if staged:
                x, branch = yield from block(x, position_ids, cu_seqlens, segment_ids, max_seqlen, staged=True,
                                             branch=branch)
            else:  # called plainly: a memory policy may have wrapped the block's forward
                x, branch = block(x, position_ids, cu_seqlens, segment_ids, max_seqlen, branch=branch)
        if self.output is None or (layers is not None and layers.stop < self.cfg.num_layers):
            x = x if branch is None else x + branch  # a pipeline chunk sends the whole stream
            return x if mtp_embedded is None else torch.cat([x, *(e.to(x.dtype) for e in mtp_embedded)], dim=-1)
        _, x = residual_norm(self.norm, x, branch, self.cfg.compile)
        if labels is None:
            return self.output(x)
        loss = self._loss(x, labels)
        if self.mtp is not None:
            loss = loss + self._mtp_loss(x, labels, mtp_labels, position_ids, cu_seqlens, segment_ids, max_seqlen,
                                         mtp_embedded)
        return loss

    def _loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.fused_loss is not None:
            return self.fused_loss(x, self.output.weight, labels)
        return self.loss_fn(self.output(x), labels)

    def _mtp_loss(self, h, labels, future, position_ids, cu_seqlens, segment_ids, max_seqlen,
                  embedded: list[torch.Tensor] | None = None) -> torch.Tensor:
        """λ/D · (Σ of the depths' cross-entropy sums, minus the same detached): exactly 0 as a value, so the model's
        loss stays the main one, while backward gives the depths their share of the gradient (mtp.py). `h`: the main
        model's normalised output; `future`: [D, T] shifted labels (`future_labels`); `embedded`: the depths' input
        embeddings where they came down the pipeline."""
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        inputs = labels  # t_{i+k+1} at 0-based depth k: labels shifted by k inside each document
        for k, (layer, following) in enumerate(zip(self.mtp, future, strict=True)):
            targets = following.masked_fill(inputs == IGNORE_INDEX, IGNORE_INDEX)
            e = embedded[k] if embedded is not None else self.embed(inputs.clamp(min=0))
            x, branch = layer(e, h, position_ids, cu_seqlens, segment_ids, max_seqlen)
            _, h = residual_norm(layer.norm, x, branch, self.cfg.compile)
            depth = self._loss(h, targets)
            total = total + depth
            self.mtp_loss_sums.add(k, depth, (targets != IGNORE_INDEX).sum())
            inputs = following
        return self.cfg.mtp_loss_coeff / len(self.mtp) * (total - total.detach())
