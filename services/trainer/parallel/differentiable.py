"""Collectives with their autograd duals, for activations that cross a tensor- or context-parallel boundary.

Each forward collective has the backward that makes the gradient exact when every rank's output feeds its own loss term:
    copy_to_group        identity     / all-reduce      (a replicated input enters rank-local compute)
    reduce_from_group    all-reduce   / identity        (partial sums leave rank-local compute)
    gather_tokens        all-gather   / reduce-scatter  (sequence-parallel shard -> full tokens)
    reduce_scatter_tokens reduce-scatter / all-gather   (partial sums -> sequence-parallel shard)
Token collectives work along dim 0 (the packed token axis) and need it divisible by the group size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup

# torch 2.13 renames the tensor-in/tensor-out collectives; 2.11 only has the old names (same signatures).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_gather_dim0(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    n = group_size(group)
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x.contiguous(), group=group)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    n = group_size(group)
    if x.shape[0] % n:
        raise ValueError(f"{x.shape[0]} tokens cannot be split evenly over a group of {n} ranks "
                         f"(make data.micro_batch_size * data.seq_len divisible by tp * cp * 2)")
    if dist.get_backend(group) == "gloo":  # gloo's reduce-scatter is missing on older torch; CPU tests only
        full = x.contiguous().clone()
        dist.all_reduce(full, group=group)
        return full.chunk(n)[group_rank(group)].contiguous()
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def all_reduce_sum(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_sum(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim0(grad, ctx.group), None


class _ReduceScatterTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


def copy_to_group(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFromGroup.apply(x, group)


def gather_tokens(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherTokens.apply(x, group)


def reduce_scatter_tokens(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceScatterTokens.apply(x, group)


def local_token_shard(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's contiguous slice of dim 0 (no communication; for inputs every rank already holds in full)."""
    n = group_size(group)
    if x.shape[0] % n:
        raise ValueError(f"{x.shape[0]} tokens cannot be split evenly over a group of {n} ranks "
                         f"(make data.micro_batch_size * data.seq_len divisible by tp * cp * 2)")
    return x.chunk(n)[group_rank(group)]
