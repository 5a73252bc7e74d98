"""What a rank of a folded layout hands the checkpointer, and how it reads its pieces back: boxes of global tensors.

Names match the single-process checkpoint (`model/<param>`, `optim/<param>/exp_avg`, `optim/<param>/exp_avg_sq`,
`optim/<param>/step`, and `optim/<param>/remainder` for bf16 parameters), so a checkpoint written by any layout is read by any other (the checkpointer reads any box).
A parameter's box: TP-sharded parameters cover their slice along `tensor_parallel_dim`; expert parameters their
experts (and, with ETP, their FFN slice — w13 is then saved in its [E, h, 2, f] view, the gate and up halves being
two column blocks; layouts with etp=1, including one process, save [E, h, 2f]; reading handles both). Copies on several ranks are marked replicated; exactly one rank writes each.

The ZeRO-1 moments (and remainders) exist on each rank only for its flat range of a bucket; at save time each bucket's
are all-gathered over the reducing group (a temporary full copy of this rank's parameters' moments) so they form boxes too.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.adamw import split_master
from services.checkpointer.shard import Shard
from services.trainer.checkpointing import saved_value
from services.trainer.parallel.distributed_optimizer import DistributedOptimizer, _all_gather_single
from services.trainer.parallel.groups import ParallelGroups


def _box(p: nn.Parameter, groups: ParallelGroups) -> tuple[tuple[int, ...], tuple[int, ...], bool, bool]:
    """(global shape, offsets, replicated, writer) of this rank's piece of `p` (in its box view)."""
    if hasattr(p, "expert_box"):
        shape, offsets = p.expert_box
        if groups.etp.size == 1 and len(shape) == 4:  # no FFN split: the single-process [E, h, 2f] layout is a box
            shape, offsets = (shape[0], shape[1], shape[2] * shape[3]), offsets[:3]
        return shape, offsets, groups.edp.size > 1, groups.edp.rank == 0
    dim = getattr(p, "tensor_parallel_dim", None)
    dense_writer = groups.dp_cp.rank == 0
    if dim is None:
        return tuple(p.shape), (0,) * p.ndim, groups.tp.size * groups.dp_cp.size > 1, dense_writer and \
            groups.tp.rank == 0
    shape = list(p.shape)
    offsets = [0] * p.ndim
    offsets[dim] = groups.tp.rank * shape[dim]
    shape[dim] *= groups.tp.size
    return tuple(shape), tuple(offsets), groups.dp_cp.size > 1, dense_writer


def _view(t: torch.Tensor, global_shape: tuple[int, ...]) -> torch.Tensor:
    return t.view(t.shape[0], t.shape[1], 2, -1) if len(global_shape) == 4 else t


def model_shards(model: nn.Module, groups: ParallelGroups) -> dict[str, Shard]:
    out = {}
    for name, p in model.named_parameters():
        shape, offsets, replicated, writer = _box(p, groups)
        out[f"model/{name}"] = Shard(_view(p.detach(), shape), shape, offsets, replicated, writer)
    stage_writer = groups.tp.rank == 0 and groups.dp_cp.rank == 0  # buffers are identical on every rank of a stage
    persistent = model.state_dict(keep_vars=True)
    for name, b in model.named_buffers():
        if name in persistent:
            out[f"model/{name}"] = Shard(b.detach(), replicated=groups.tp.size * groups.dp_cp.size > 1,
                                         writer=stage_writer)
    return out


def _full_moment(opt: DistributedOptimizer, bucket, which: str) -> torch.Tensor:
    local = getattr(bucket, which)
    if not opt.shard or bucket.axis.size == 1:
        return local
    full = torch.empty(bucket.size, dtype=local.dtype, device=local.device)
    # NCCL and gloo have no int16 type: the remainders travel as the bf16 of the same bits (a gather only moves them)
    wire = torch.bfloat16 if local.dtype == torch.int16 else local.dtype
    _all_gather_single(full.view(wire), local.contiguous().view(wire), group=bucket.axis.group)
    return full


def optimizer_shards(opt: DistributedOptimizer, groups: ParallelGroups) -> dict[str, Shard]:
    """The moments and step; for bf16 parameters also the remainders of their fp32 master weights (beside the bf16
    values `model_shards` names, they make a checkpoint hold the parameters' true values whatever the layout)."""
    out = {}
    for b in opt.buckets:
        keys = ("exp_avg", "exp_avg_sq") + (() if b.remainder is None else ("remainder",))
        moments = {k: _full_moment(opt, b, k) for k in keys}
        for s in b.slots:
            shape, offsets, replicated, writer = _box(s.param, groups)
            for key, flat in moments.items():
                piece = _view(flat[s.start:s.start + s.numel].view_as(s.param), shape).clone()
                out[f"optim/{s.name}/{key}"] = Shard(piece, shape, offsets, replicated, writer)
            out[f"optim/{s.name}/step"] = Shard(torch.tensor([float(opt.step_count)]), replicated=True,
                                                writer=writer)
    return out


def _read(ckpt, name: str, p: nn.Parameter, groups: ParallelGroups) -> torch.Tensor:
    """This rank's piece of `name` for parameter `p`, shaped like `p`; w13 may be saved in either layout."""
    if hasattr(p, "expert_box") and len(p.expert_box[0]) == 4:  # w13: [El, h, 2·fl] = gate | up column blocks
        (E, h, _, f), (e0, _, _, f0) = p.expert_box
        El, fl = p.shape[0], p.shape[2] // 2
        if len(ckpt.global_shape(name)) == 4:
            return ckpt.read(name, (e0, 0, 0, f0), (El, h, 2, fl)).reshape(p.shape)
        gate = ckpt.read(name, (e0, 0, f0), (El, h, fl))
        up = ckpt.read(name, (e0, 0, f + f0), (El, h, fl))
        return torch.cat([gate, up], dim=-1)
    shape, offsets, _, _ = _box(p, groups)
    return ckpt.read(name, offsets, tuple(p.shape))


@torch.no_grad()
def load_shards(ckpt, model: nn.Module, opt: DistributedOptimizer, groups: ParallelGroups) -> None:
    """Read this rank's boxes of every parameter, buffer and moment from `ckpt` (a `load.Checkpoint`)."""
    # A step's parameter all-gathers still in flight would land after (and over) what is read here.
    opt.wait_params()
    saved = set(ckpt.names())

    slot_of = {s.name: (b, s) for b in opt.buckets for s in b.slots}
    for name, p in model.named_parameters():
        value = saved_value(lambda n: _read(ckpt, n, p, groups), name, saved).float()  # the fp32 master weight
        if p.dtype != torch.bfloat16:
            p.data.copy_(value)
            continue
        # the rounding its remainder is kept against (every replica the same), not torch's; the remainder's part in
        # this rank's owned range of the bucket comes from the same split (one read of the checkpoint per parameter)
        rounded, remainder = split_master(value)
        p.data.copy_(rounded)
        b, s = slot_of[name]
        lo, hi = max(s.start, b.lo), min(s.start + s.numel, b.hi)
        if lo < hi:
            b.remainder[lo - b.lo:hi - b.lo] = remainder.reshape(-1)[lo - s.start:hi - s.start]
    for name, b in model.named_buffers():
        if f"model/{name}" in saved:
            b.copy_(ckpt.read(f"model/{name}"))
    for bucket in opt.buckets:
        for key in ("exp_avg", "exp_avg_sq"):
            full = torch.zeros(bucket.size, dtype=torch.float32, device=bucket.params.device)
            for s in bucket.slots:
                name = f"optim/{s.name}/{key}"
                if name in saved:
                    full[s.start:s.start + s.numel] = _read(ckpt, name, s.param, groups).reshape(-1)
            getattr(bucket, key).copy_(full[bucket.lo:bucket.hi])
        step_name = f"optim/{bucket.slots[0].name}/step"
        if step_name in saved:
            opt.step_count = int(ckpt.read(step_name).reshape(-1)[0])
