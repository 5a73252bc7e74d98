"""Tensor parallelism with sequence parallelism (Megatron-style), applied to the single-device model.

Attention and every dense SwiGLU (dense layers, shared experts) become a *TP region*: the input projections (q/k/v,
gate/up) keep a slice of their output features (whole heads; whole FFN columns), the output projection (o_proj, down)
keeps the matching slice of its input features, so a region needs one collective on the way in and one on the way out.
With sequence parallelism the residual stream between regions is sharded along tokens over TP: the region entry
all-gathers tokens, the exit reduce-scatters them. Norms, the router and the routed experts then run on the rank's token
shard, which is why their parameter gradients are partial over TP (the norm scales, the router weight and the shared
expert's gate get a backward hook that all-reduces them over TP; the routed experts are reduced over EDP by the expert
grouping). The optional QK-norm scales live inside the attention region, whole on every rank but applied to the rank's
heads only, so they get the same hook, with or without sequence parallelism. Multi-head Latent Attention splits its
heads the same way (q_proj or q_b_proj and kv_b_proj column parallel, o_proj row parallel); its latent projections and
norms (q_a_proj, q_a_layernorm, kv_a_proj_with_mqa with the shared RoPE key, kv_a_layernorm) are whole on every rank and
feed only the rank's heads, so their gradients are partial over TP too and get the hook.

The embedding and output layer are split over the vocabulary; the loss is a vocab-parallel cross-entropy in fp32, so
no rank ever materialises full-vocabulary logits. With `model.moe_kernels: [cross_entropy]` (the default) the output
layer and that loss run as one chunked op that holds no [T, V/tp] logits either (kernels/cross_entropy.py).

With `model.fp8` the sharded projections are `FP8Linear`s (services/trainer/model/fp8_linear.py): their own forward
runs on the rank's shard, in FP8 through Transformer Engine on CUDA, with TE in its non-parallel mode; the region
hooks here do all the communication, in the activations' dtype, exactly as without FP8.

The q/k/v biases (`model.qkv_bias`) are split with their heads. Sharded parameters carry `tensor_parallel_dim` (the dim
split over TP) so checkpointing and tests can reassemble them; parameters whose gradient a hook all-reduces over TP
carry `sequence_parallel=True`.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kernels.cross_entropy import linear_cross_entropy_sum
from services.trainer.model.attention import Attention
from services.trainer.model.loss import IGNORE_INDEX
from services.trainer.model.mla import MLAttention
from services.trainer.model.mlp import SwiGLUMLP
from services.trainer.model.mtp import MTPLayer
from services.trainer.model.moe.moe_layer import MoELayer
from services.trainer.parallel.differentiable import (all_reduce_sum, copy_to_group, gather_tokens, group_rank,
                                                      group_size, local_token_shard, reduce_from_group,
                                                      reduce_scatter_tokens)

ProcessGroup = dist.ProcessGroup


# ---------------------------------------------------------------- sharding helpers


def shard_parameter(param: nn.Parameter, dim: int, group: ProcessGroup) -> nn.Parameter:
    """This rank's contiguous slice of `param` along `dim`, as a new parameter tagged with the split dim."""
    n, r = group_size(group), group_rank(group)
    if param.shape[dim] % n:
        raise ValueError(f"a parameter of shape {tuple(param.shape)} cannot be split over tp={n} along dim {dim}")
    shard = nn.Parameter(param.detach().chunk(n, dim=dim)[r].clone(), requires_grad=param.requires_grad)
    shard.tensor_parallel_dim = dim
    return shard


def _shard_linear(linear: nn.Linear, dim: int, group: ProcessGroup) -> None:
    """dim 0: keep a slice of output features (column parallel) and of the bias (Qwen2's q/k/v); dim 1: of input
    features (row parallel: bias-free, as a bias there would be summed tp times)."""
    if linear.bias is not None:
        if dim != 0:
            raise ValueError("a row-parallel linear cannot have a bias (each rank's partial sum would add it)")
        linear.bias = shard_parameter(linear.bias, 0, group)
    linear.weight = shard_parameter(linear.weight, dim, group)
    linear.out_features, linear.in_features = linear.weight.shape


def _reduce_grad_over(group: ProcessGroup, grad: torch.Tensor) -> torch.Tensor:
    return all_reduce_sum(grad, group)


def mark_sequence_parallel(param: nn.Parameter, group: ProcessGroup) -> None:
    """`param` is used on this rank's token shard only: sum its gradient over TP as it is produced.

    A tensor hook sees each backward's contribution before it is accumulated into `.grad`, so gradient accumulation over
    micro-batches stays a plain sum.
    """
    param.register_hook(partial(_reduce_grad_over, group))
    param.sequence_parallel = True


# ---------------------------------------------------------------- TP regions (hooks keep names and state_dict keys)


def _enter_region(group: ProcessGroup, sequence_parallel: bool, module: nn.Module, args: tuple):
    x, *rest = args
    return (gather_tokens(x, group) if sequence_parallel else copy_to_group(x, group), *rest)


def _leave_region(group: ProcessGroup, sequence_parallel: bool, module: nn.Module, args: tuple, out: torch.Tensor):
    return reduce_scatter_tokens(out, group) if sequence_parallel else reduce_from_group(out, group)


def _make_region(module: nn.Module, group: ProcessGroup, sequence_parallel: bool) -> None:
    module.register_forward_pre_hook(partial(_enter_region, group, sequence_parallel))
    module.register_forward_hook(partial(_leave_region, group, sequence_parallel))


def parallelize_attention(attn: Attention, group: ProcessGroup, sequence_parallel: bool) -> None:
    n = group_size(group)
    if attn.num_heads % n or attn.num_kv_heads % n:
        raise ValueError(f"tp={n} must divide num_heads={attn.num_heads} and num_kv_heads={attn.num_kv_heads}")
    # Contiguous head slices keep GQA grouping: query head i uses kv head i // (Hq/Hkv) on every rank alike.
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        _shard_linear(proj, 0, group)
    _shard_linear(attn.o_proj, 1, group)
    # QK-norm scales (one [head_dim] vector shared by all heads) stay whole on every rank, but each rank applies them to
    # its own heads only: their gradient is partial over TP with or without sequence parallelism.
    for norm in (attn.q_norm, attn.k_norm):
        if norm is not None:
            mark_sequence_parallel(norm.weight, group)
    _make_region(attn, group, sequence_parallel)


def parallelize_mla(attn: MLAttention, group: ProcessGroup, sequence_parallel: bool) -> None:
    n = group_size(group)
    if attn.num_heads % n:
        raise ValueError(f"tp={n} must divide num_heads={attn.num_heads}")
    # Output rows are per head ([nope | rope] for q, [k_nope | v] for kv_b_proj): contiguous slices are whole heads.
    for proj in (attn.q_proj if attn.q_proj is not None else attn.q_b_proj, attn.kv_b_proj):
        _shard_linear(proj, 0, group)
    _shard_linear(attn.o_proj, 1, group)
    # Whole on every rank, read by the rank's heads only: each rank's gradient is its heads' share.
    for module in (attn.q_a_proj, attn.q_a_layernorm, attn.kv_a_proj_with_mqa, attn.kv_a_layernorm):
        if module is not None:
            mark_sequence_parallel(module.weight, group)
    _make_region(attn, group, sequence_parallel)


def parallelize_swiglu(mlp: SwiGLUMLP, group: ProcessGroup, sequence_parallel: bool) -> None:
    _shard_linear(mlp.gate_proj, 0, group)
    _shard_linear(mlp.up_proj, 0, group)
    _shard_linear(mlp.down_proj, 1, group)
    _make_region(mlp, group, sequence_parallel)


def _moe_on_token_shard(group: ProcessGroup, module: nn.Module, args: tuple):
    """The MoE layer sees this rank's tokens; its per-token segment ids must be cut the same way."""
    if len(args) > 1 and args[1] is not None:
        return (args[0], local_token_shard(args[1], group), *args[2:])
    return None


# ---------------------------------------------------------------- vocab parallel embedding, output layer and loss


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + V/tp) of the embedding; other ids contribute zeros and the sum over TP completes them."""

    def __init__(self, full: nn.Embedding, group: ProcessGroup, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = shard_parameter(full.weight, 0, group)
        self.vocab_start = group_rank(group) * self.weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """ids [T, ...] -> [T, ..., h] (under sequence parallelism this rank's share of the T tokens)."""
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        return reduce_scatter_tokens(out, self.group) if self.sequence_parallel else reduce_from_group(out, self.group)


class VocabParallelOutput(nn.Module):
    """Output layer split over the vocabulary: [T(/tp), h] -> logits for this rank's vocab slice [T, V/tp]."""

    def __init__(self, full: nn.Linear, group: ProcessGroup, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = shard_parameter(full.weight, 0, group)
        self.vocab_start = group_rank(group) * self.weight.shape[0]

    def all_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Every token of the micro-batch; backward sums their gradient, partial over the vocabulary, over TP."""
        return gather_tokens(x, self.group) if self.sequence_parallel else copy_to_group(x, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.all_tokens(x), self.weight)


def vocab_parallel_linear_cross_entropy(output: VocabParallelOutput, x: torch.Tensor, weight: torch.Tensor,
                                        labels: torch.Tensor) -> torch.Tensor:
    """The model's fused output layer + loss (`model.moe_kernels: [cross_entropy]`) over this rank's vocabulary
    slice: chunked, no [T, V/tp] logits held, three fp32 numbers per token exchanged (kernels/cross_entropy.py)."""
    return linear_cross_entropy_sum(output.all_tokens(x), weight, labels, vocab_group=output.group,
                                    vocab_start=output.vocab_start)


class _VocabParallelTokenLogprobs(torch.autograd.Function):
    """log softmax(logits)[label] per token [T] fp32, the vocabulary split over `group`: three all-reduces of [T]
    vectors (max, Σexp, target logit) replace a gather of [T, V] logits. Positions labelled IGNORE_INDEX give 0 and
    no gradient. The cross-entropy loss and RL's policy log-probs are both this."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, group: ProcessGroup):
        x = logits.float()
        row_max = x.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = x - row_max[:, None]
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        local = labels - vocab_start
        valid = labels != IGNORE_INDEX
        here = valid & (local >= 0) & (local < x.shape[-1])
        idx = local.clamp(0, x.shape[-1] - 1)
        target = shifted.gather(1, idx[:, None]).squeeze(1) * here
        dist.all_reduce(target, group=group)
        ctx.save_for_backward(exp.div_(sum_exp[:, None]), idx, here, valid)
        ctx.logits_dtype = logits.dtype
        return (target - sum_exp.log()) * valid

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, idx, here, valid = ctx.saved_tensors  # d log p(y) / d z_v = 1[v = y] - softmax_v
        g = softmax.neg_()
        g.scatter_add_(1, idx[:, None], here.to(g.dtype)[:, None])
        g.mul_((grad.float() * valid)[:, None])
        return g.to(ctx.logits_dtype), None, None, None


class VocabParallelCrossEntropy:
    """Drop-in for `cross_entropy_sum(logits, labels)` when logits are this rank's vocab slice: Σ -log p(label)."""

    def __init__(self, group: ProcessGroup, vocab_start: int):
        self.group, self.vocab_start = group, vocab_start

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return -_VocabParallelTokenLogprobs.apply(logits, labels, self.vocab_start, self.group).sum()


def vocab_parallel_token_logprobs(logits: torch.Tensor, labels: torch.Tensor, loss_fn: VocabParallelCrossEntropy
                                  ) -> torch.Tensor:
    """Per-token log-probs of `labels` [T] from this rank's vocab slice of the logits [T, V/tp] (the model's
    vocab-parallel `loss_fn` names the group and the slice); 0 where a label is IGNORE_INDEX."""
    return _VocabParallelTokenLogprobs.apply(logits, labels, loss_fn.vocab_start, loss_fn.group)


# ---------------------------------------------------------------- the entry point


def apply_tensor_parallel(model: nn.Module, group: ProcessGroup | None, sequence_parallel: bool = True) -> nn.Module:
    """Shard `model` (an initialised `MoETransformer`, or a pipeline stage of one) over the TP `group`, in place.

    Every rank must hold the same full weights before the call: each keeps its slice, so a parallel run starts from
    exactly the single-device initialisation. The model's `loss_fn` becomes the vocab-parallel cross-entropy, and its
    fused output layer + loss (`model.moe_kernels: [cross_entropy]`) the vocab-parallel chunked one.
    """
    if group_size(group) == 1:
        return model
    if getattr(model, "tensor_parallel_group", None) is not None:
        raise RuntimeError("apply_tensor_parallel was already applied to this model")
    has_moe = any(isinstance(m, MoELayer) for m in model.modules())
    if has_moe and not sequence_parallel:
        raise ValueError("MoE layers under tensor parallelism need `parallel.sequence_parallel=true`: without it every "
                         "TP rank would route and compute the same tokens")
    for module in list(model.modules()):
        if isinstance(module, Attention):
            parallelize_attention(module, group, sequence_parallel)
        elif isinstance(module, MLAttention):
            parallelize_mla(module, group, sequence_parallel)
        elif isinstance(module, MTPLayer) and sequence_parallel:
            # Whole on every rank, applied to the rank's token shard: gradients partial over TP, as the norms'.
            mark_sequence_parallel(module.eh_proj.weight, group)
        elif isinstance(module, SwiGLUMLP):  # dense FFN or a MoE layer's shared expert
            parallelize_swiglu(module, group, sequence_parallel)
        elif isinstance(module, MoELayer) and sequence_parallel:
            module.register_forward_pre_hook(partial(_moe_on_token_shard, group))
            mark_sequence_parallel(module.router.weight, group)
            if module.shared_expert_gate is not None:  # read from the rank's tokens, as the router
                mark_sequence_parallel(module.shared_expert_gate.weight, group)
            module.router.sp_group = group  # aux/z-loss statistics over the whole micro-batch
        elif (isinstance(module, nn.RMSNorm) and sequence_parallel and module.weight is not None
              and not getattr(module.weight, "sequence_parallel", False)):  # QK/latent norms: hooked by attention
            mark_sequence_parallel(module.weight, group)
    if getattr(model, "embed", None) is not None:
        model.embed = VocabParallelEmbedding(model.embed, group, sequence_parallel)
    if getattr(model, "output", None) is not None:
        model.output = VocabParallelOutput(model.output, group, sequence_parallel)
        model.loss_fn = VocabParallelCrossEntropy(group, model.output.vocab_start)
        if model.fused_loss is not None:
            model.fused_loss = partial(vocab_parallel_linear_cross_entropy, model.output)
    model.tensor_parallel_group = group
    model.sequence_parallel = sequence_parallel
    return model
