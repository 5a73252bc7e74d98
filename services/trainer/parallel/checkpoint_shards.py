"""What a rank of a folded layout hands the checkpointer, and how it reads its pieces back: boxes of global tensors.

Names match the single-process checkpoint (`model/<param>`, `optim/<param>/exp_avg`, `optim/<param>/exp_avg_sq`,
`optim/<param>/step`, and `optim/<param>/remainder` for bf16 parameters), so a checkpoint written by any layout is read by any other (the checkpointer reads any box).
A parameter's box: TP-sharded parameters cover their slice along `tensor_parallel_dim`; expert parameters their
experts (and, with ETP, their FFN slice — w13 is then saved in its [E, h, 2, f] view, the gate and up halves being
two column blocks; layouts with etp=1, including one process, save [E, h, 2f]; reading handles both). Copies on several ranks are marked replicated; exactly one rank writes each.

Under ZeRO-1 a bucket's moments (and remainders) live on each rank of its reducing group for one flat range only; a
save hands exactly that range, of the moments and of the parameters themselves (which every rank of the group holds
whole): a flat range of a tensor is up to 2·ndim - 1 boxes (`flat_range_boxes`), handed as pieces of the one tensor
(shard.piece_key). So every rank of a data-parallel group copies and writes its 1/n of the state, nothing is gathered,
and the save's stall is each rank's own device-to-host copy; any layout still reads any box back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import closing
from functools import partial

import torch
from torch import nn

from kernels.adamw import split_master
from services.checkpointer.load import Box
from services.checkpointer.shard import Shard, piece_key
from services.trainer.checkpointing import REMAINDER, saved_value
from services.trainer.parallel.distributed_optimizer import DistributedOptimizer
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


def flat_range_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, shape) boxes covering elements [lo, hi) of a C-ordered tensor of `shape`, in element order, each one
    contiguous in that order: a partial first row, whole rows, a partial last row (recursively), at most 2·ndim - 1."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    row = math.prod(shape[1:])
    first, last = lo // row, (hi - 1) // row
    if first == last:  # inside one row: the row's own sub-boxes
        return [((first, *o), (1, *n)) for o, n in flat_range_boxes(shape[1:], lo - first * row, hi - first * row)]
    boxes = []
    if lo % row:
        boxes += [((first, *o), (1, *n)) for o, n in flat_range_boxes(shape[1:], lo % row, row)]
        first += 1
    whole_end = hi // row
    if whole_end > first:
        boxes.append(((first,) + (0,) * (len(shape) - 1), (whole_end - first, *shape[1:])))
    if hi % row:
        boxes += [((whole_end, *o), (1, *n)) for o, n in flat_range_boxes(shape[1:], 0, hi % row)]
    return boxes


def _owned_pieces(name: str, flat: torch.Tensor, local_shape: tuple[int, ...], lo: int, hi: int,
                  box: tuple[tuple[int, ...], tuple[int, ...], bool, bool]) -> dict[str, Shard]:
    """Elements [lo, hi) of a local piece laid out as `local_shape` at `box` (global shape, offsets, replicated,
    writer); `flat` holds exactly those elements, in order."""
    shape, offsets, replicated, writer = box
    boxes = flat_range_boxes(local_shape, lo, hi)
    out, start = {}, 0
    for i, (at, size) in enumerate(boxes):
        n = math.prod(size)
        key = name if len(boxes) == 1 else piece_key(name, i)
        out[key] = Shard(flat[start:start + n].view(size), shape, tuple(o + a for o, a in zip(offsets, at)),
                         replicated, writer)
        start += n
    return out


def _owner_box(p: nn.Parameter, groups: ParallelGroups, bucket) -> tuple:
    """`_box` of `p` for the flat range this rank owns. Under ZeRO-1 the ranks of the bucket's reducing group own
    disjoint ranges: an expert bucket's group (EDP) holds every copy of its parameters; a dense bucket's (DP x CP)
    leaves copies on the TP ranks of a parameter tensor parallelism does not split, of which TP rank 0 writes."""
    shape, offsets, replicated, writer = _box(p, groups)
    if not bucket.sharded:
        return shape, offsets, replicated, writer
    copies = bucket.domain == "dense" and getattr(p, "tensor_parallel_dim", None) is None and groups.tp.size > 1
    return shape, offsets, copies, not copies or groups.tp.rank == 0


def training_shards(model: nn.Module, opt: DistributedOptimizer, groups: ParallelGroups) -> dict[str, Shard]:
    """Everything this rank of a folded layout saves of the model and optimizer: the buffers (and any parameter no
    bucket holds) as `model_shards` names them, the bucketed parameters and their state as `optimizer_shards` does."""
    bucketed = {f"model/{s.name}" for b in opt.buckets for s in b.slots}
    whole = {name: shard for name, shard in model_shards(model, groups).items() if name not in bucketed}
    return whole | optimizer_shards(opt, groups)


def optimizer_shards(opt: DistributedOptimizer, groups: ParallelGroups) -> dict[str, Shard]:
    """Every bucketed parameter with its moments and step, and for bf16 parameters the remainders of their fp32 master
    weights (with the bf16 values they make a checkpoint hold the parameters' true values whatever the layout), each in
    the flat range this rank owns (all of it without ZeRO-1)."""
    out = {}
    for b in opt.buckets:
        keys = ("exp_avg", "exp_avg_sq") + (() if b.remainder is None else ("remainder",))
        for s in b.slots:
            lo, hi = max(s.start, b.lo), min(s.start + s.numel, b.hi)  # bucket coordinates
            box = _owner_box(s.param, groups, b)
            local_shape = tuple(_view(s.param, box[0]).shape)
            if lo < hi:
                flats = {f"model/{s.name}": s.param.detach().reshape(-1)[lo - s.start:hi - s.start]}
                flats.update({f"optim/{s.name}/{k}": getattr(b, k)[lo - b.lo:hi - b.lo] for k in keys})
                for name, flat in flats.items():
                    out.update(_owned_pieces(name, flat, local_shape, lo - s.start, hi - s.start, box))
            _, _, replicated, writer = _box(s.param, groups)
            out[f"optim/{s.name}/step"] = Shard(torch.tensor([float(opt.step_count)]), replicated=True,
                                                writer=writer)
    return out


def local_boxes(ckpt, name: str, p: nn.Parameter, groups: ParallelGroups) -> list[Box]:
    """The boxes of `name` that hold this rank's piece of it for parameter `p` (`local_piece` joins them): the
    parameter's box, or for w13 saved without an FFN split ([E, h, 2f]) its gate and up column blocks."""
    if hasattr(p, "expert_box") and len(p.expert_box[0]) == 4:  # w13: [El, h, 2·fl] = gate | up column blocks
        (E, h, _, f), (e0, _, _, f0) = p.expert_box
        El, fl = p.shape[0], p.shape[2] // 2
        if len(ckpt.global_shape(name)) == 4:
            return [(name, (e0, 0, 0, f0), (El, h, 2, fl))]
        return [(name, (e0, 0, f0), (El, h, fl)), (name, (e0, 0, f + f0), (El, h, fl))]
    _, offsets, _, _ = _box(p, groups)
    return [(name, offsets, tuple(p.shape))]


def local_piece(boxes: list[torch.Tensor], p: nn.Parameter) -> torch.Tensor:
    """The boxes `local_boxes` named, read, as one piece shaped like `p`."""
    return torch.cat(boxes, dim=-1) if len(boxes) == 2 else boxes[0].reshape(p.shape)


def read_local(ckpt, name: str, p: nn.Parameter, groups: ParallelGroups) -> torch.Tensor:
    """This rank's piece of `name` for parameter `p`, shaped like `p`, from `ckpt` (anything with `global_shape` and
    `read(name, offsets, shape)`: a checkpoint, or the initial weights); w13 may be saved in either layout."""
    return local_piece([ckpt.read(*box) for box in local_boxes(ckpt, name, p, groups)], p)


# What `load_shards` reads and does with it: boxes, and what puts them in place once read (given them by name).
Load = tuple[list[Box], Callable[[dict[str, list[torch.Tensor]]], None]]


@torch.no_grad()
def load_shards(ckpt, model: nn.Module, opt: DistributedOptimizer, groups: ParallelGroups) -> None:
    """Read this rank's boxes of every parameter, buffer and moment from `ckpt` (a `load.Checkpoint` or a
    `remote.RemoteCheckpoint`). Every box is asked for in one `read_boxes`, so that through the checkpointer the next
    boxes are on their way while one is put in place; each is put in place as it arrives (what is held at a time is one
    parameter's boxes and the requests in flight, not the rank's state)."""
    # A step's parameter all-gathers still in flight would land after (and over) what is read here.
    opt.wait_params()
    saved = set(ckpt.names())
    for bucket in opt.buckets:  # a moment not saved, and the padding, restore as zeros (as a fresh optimizer's)
        bucket.exp_avg.zero_()
        bucket.exp_avg_sq.zero_()
    loads = [*_parameter_loads(ckpt, model, opt, groups, saved), *_buffer_loads(model, saved),
             *_optimizer_loads(ckpt, opt, groups, saved)]
    with closing(ckpt.read_boxes([box for boxes, _ in loads for box in boxes])) as read:
        for boxes, put in loads:
            got: dict[str, list[torch.Tensor]] = {}
            for name, _, _ in boxes:
                got.setdefault(name, []).append(next(read))
            put(got)


def _parameter_loads(ckpt, model: nn.Module, opt: DistributedOptimizer, groups: ParallelGroups,
                     saved: set[str]) -> Iterator[Load]:
    slot_of = {s.name: (b, s) for b in opt.buckets for s in b.slots}
    for name, p in model.named_parameters():
        names = [f"model/{name}"] + [n for n in [REMAINDER.format(name)] if n in saved]
        yield ([box for n in names for box in local_boxes(ckpt, n, p, groups)],
               partial(_put_parameter, p, name, slot_of.get(name), saved))


def _put_parameter(p: nn.Parameter, name: str, slot, saved: set[str], got: dict[str, list[torch.Tensor]]) -> None:
    value = saved_value(lambda n: local_piece(got[n], p), name, saved).float()  # the fp32 master weight
    if p.dtype != torch.bfloat16:
        p.data.copy_(value)
        return
    # the rounding its remainder is kept against (every replica the same), not torch's; the remainder's part in this
    # rank's owned range of the bucket comes from the same split (one read of the checkpoint per parameter)
    rounded, remainder = split_master(value)
    p.data.copy_(rounded)
    b, s = slot
    lo, hi = max(s.start, b.lo), min(s.start + s.numel, b.hi)
    if lo < hi:
        b.remainder[lo - b.lo:hi - b.lo] = remainder.reshape(-1)[lo - s.start:hi - s.start]


def _buffer_loads(model: nn.Module, saved: set[str]) -> Iterator[Load]:
    for name, b in model.named_buffers():
        if f"model/{name}" in saved:
            yield [(f"model/{name}", None, None)], partial(_put_whole, b, f"model/{name}")


def _put_whole(t: torch.Tensor, name: str, got: dict[str, list[torch.Tensor]]) -> None:
    t.copy_(got[name][0])


def _optimizer_loads(ckpt, opt: DistributedOptimizer, groups: ParallelGroups, saved: set[str]) -> Iterator[Load]:
    """Each moment's part in the range of its bucket this rank owns, read as the boxes of that part only (a slot
    outside the range is not read, one partly inside reads its part), and the step."""
    for bucket in opt.buckets:
        for key in ("exp_avg", "exp_avg_sq"):
            for s in bucket.slots:
                name = f"optim/{s.name}/{key}"
                lo, hi = max(s.start, bucket.lo), min(s.start + s.numel, bucket.hi)
                if name in saved and lo < hi:
                    boxes, join = owned_boxes(ckpt, name, s.param, groups, lo - s.start, hi - s.start)
                    yield boxes, partial(_put_moment, getattr(bucket, key)[lo - bucket.lo:hi - bucket.lo], name, join)
        step_name = f"optim/{bucket.slots[0].name}/step"
        if step_name in saved:
            yield [(step_name, None, None)], partial(_put_step, opt, step_name)


def owned_boxes(ckpt, name: str, p: nn.Parameter, groups: ParallelGroups, lo: int,
                hi: int) -> tuple[list[Box], Callable[[list[torch.Tensor]], torch.Tensor]]:
    """The boxes of `name` that hold elements [lo, hi) of this rank's piece of it for parameter `p` (in `p`'s element
    order), and what joins them, read, into those elements as one flat tensor. The range's boxes of the local piece
    (`flat_range_boxes`) are boxes of the saved tensor, except for w13 saved without an FFN split ([E, h, 2f]), where
    a box across the gate and up halves is read as one box per half and stacked back."""
    if hasattr(p, "expert_box") and len(p.expert_box[0]) == 4:  # w13: [El, h, 2·fl] viewed as [El, h, 2, fl]
        (_, h, _, f), (e0, _, _, f0) = p.expert_box
        ranges = flat_range_boxes((p.shape[0], h, 2, p.shape[2] // 2), lo, hi)
        if len(ckpt.global_shape(name)) == 4:
            boxes = [(name, (e0 + a, b, c, f0 + d), size) for (a, b, c, d), size in ranges]
            return boxes, lambda got: torch.cat([t.reshape(-1) for t in got])
        halves = [range(c, c + size[2]) for (_, _, c, _), size in ranges]
        boxes = [(name, (e0 + a, b, half * f + f0 + d), (A, B, D))
                 for ((a, b, _, d), (A, B, _, D)), hs in zip(ranges, halves) for half in hs]

        def join(got: list[torch.Tensor]) -> torch.Tensor:
            it = iter(got)
            return torch.cat([torch.stack([next(it) for _ in hs], dim=2).reshape(-1) for hs in halves])
        return boxes, join
    _, offsets, _, _ = _box(p, groups)
    boxes = [(name, tuple(o + a for o, a in zip(offsets, at)), size)
             for at, size in flat_range_boxes(tuple(p.shape), lo, hi)]
    return boxes, lambda got: torch.cat([t.reshape(-1) for t in got])


def _put_moment(owned: torch.Tensor, name: str, join: Callable[[list[torch.Tensor]], torch.Tensor],
                got: dict[str, list[torch.Tensor]]) -> None:
    owned.copy_(join(got[name]))


def _put_step(opt: DistributedOptimizer, name: str, got: dict[str, list[torch.Tensor]]) -> None:
    opt.step_count = int(got[name][0].reshape(-1)[0])
