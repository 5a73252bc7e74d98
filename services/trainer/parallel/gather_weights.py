"""Full, unsharded weights of a folded layout on one rank, one tensor at a time (RL weight sync, exports).

Every rank of a folded layout holds boxes of the single-process tensors: TP slices, EP/ETP expert blocks, PP stages
(`checkpoint_shards` knows each box's global shape and offsets, and which one rank "writes" each distinct box among its
DP/EDP/TP copies). `WeightGather` reuses that geometry: at construction the ranks exchange it once (one small object
all-gather), and every call streams, name by name in the single-process `state_dict` order, the writers' pieces to the
destination rank point to point, cast to the sync dtype *before* they travel. The destination assembles one full tensor
at a time on its device (a tensor it holds whole is handed out as it is, no copy) and its caller copies each to the host
as it comes (the RL publisher: into its page-locked buffers, without a wait per tensor); no other rank ever holds more
than its own pieces, and no all-gather of the model happens.

Every rank must run the generator to its end (the sends are collective with the destination's receives); only the
destination gets tensors out of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from services.common.host_memory import TensorSpec
from services.trainer.parallel.checkpoint_shards import model_shards
from services.trainer.parallel.groups import ParallelGroups

_PREFIX = "model/"


@dataclass(frozen=True)
class _Piece:
    rank: int
    shape: tuple[int, ...]  # the piece, in its box view
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class _Plan:
    name: str
    global_shape: tuple[int, ...]  # the box view (w13 under ETP: [E, h, 2, f])
    full_shape: tuple[int, ...]  # the single-process shape
    dtype: torch.dtype
    pieces: tuple[_Piece, ...]


class WeightGather:
    """`WeightGather(model, groups)` on every rank (collective); then `items(dtype)` on every rank, consumed to the
    end: (name, full host tensor) pairs on `dst`, nothing elsewhere. `model` is this rank's parallelized piece."""

    def __init__(self, model: nn.Module, groups: ParallelGroups, dst: int = 0):
        self.model, self.groups, self.dst = model, groups, dst
        self.rank = groups.global_rank
        self.plan = self._make_plan()

    def _local(self) -> dict[str, object]:
        shards = model_shards(self.model, self.groups)
        return {name[len(_PREFIX):]: s for name, s in shards.items()}

    def _make_plan(self) -> list[_Plan]:
        local = self._local()
        order = list(self.model.state_dict(keep_vars=True).keys())  # this stage's names, single-process order
        if set(order) != set(local):
            raise RuntimeError(f"state_dict and the checkpoint shards name different tensors: "
                               f"{sorted(set(order) ^ set(local))}")
        mine = [(n, local[n].global_shape, local[n].offsets, tuple(local[n].tensor.shape), local[n].written,
                 tuple(self._full_shape(n, local[n])), str(local[n].tensor.dtype)) for n in order]
        everyone: list = [None] * self.groups.world.size
        if self.groups.world.size > 1:
            dist.all_gather_object(everyone, mine)
        else:
            everyone = [mine]
        plans: dict[str, dict] = {}
        for rank, entries in enumerate(everyone):
            orders = _model_order([entry[0] for entry in entries])
            for (name, gshape, offsets, shape, written, full, dtype), order in zip(entries, orders):
                p = plans.setdefault(name, dict(global_shape=gshape, full_shape=full, dtype=dtype, pieces=[],
                                                order=order))
                if p["global_shape"] != gshape:
                    raise RuntimeError(f"ranks disagree on the global shape of {name}: {p['global_shape']} vs {gshape}")
                if written:
                    p["pieces"].append(_Piece(rank, shape, offsets))
        out = []
        # In the single-process order: stages in rank order are model order, but a rank with virtual pipeline stages
        # holds layers from several places (rank 0: layers of chunks 0, pp, ...). A stable sort by layer id.
        for name, p in sorted(plans.items(), key=lambda item: item[1]["order"]):
            covered = sum(int(torch.tensor(pc.shape).prod()) for pc in p["pieces"])
            if covered != int(torch.tensor(p["global_shape"]).prod()):
                raise RuntimeError(f"the written boxes of {name} cover {covered} of its "
                                   f"{list(p['global_shape'])} elements; the layout's shard geometry is inconsistent")
            out.append(_Plan(name, p["global_shape"], p["full_shape"], getattr(torch, p["dtype"].split(".")[-1]),
                             tuple(p["pieces"])))
        return out

    @staticmethod
    def _full_shape(name: str, shard) -> tuple[int, ...]:
        g = shard.global_shape
        return (g[0], g[1], g[2] * g[3]) if len(g) == 4 else g  # w13's [E, h, 2, f] box view is [E, h, 2f] whole

    def specs(self, dtype: torch.dtype | None = None) -> dict[str, TensorSpec]:
        """What `items(dtype)` yields on `dst`: each full tensor's shape and dtype, in its order."""
        return {plan.name: TensorSpec(tuple(plan.full_shape), self._wire(plan, dtype)) for plan in self.plan}

    @staticmethod
    def _wire(plan: _Plan, dtype: torch.dtype | None) -> torch.dtype:
        return plan.dtype if (dtype is None or not plan.dtype.is_floating_point) else dtype

    @torch.no_grad()
    def items(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream the full tensors (floating ones cast to `dtype`, None: as stored) to `dst`, one at a time, on its
        device: valid until the next one is asked for (a tensor `dst` holds whole may be its own parameter)."""
        self.model.state_dict(keep_vars=True)  # its pre-hook waits for a distributed optimizer's parameter all-gathers
        local = self._local()
        device = self._device()
        for plan in self.plan:
            wire = self._wire(plan, dtype)
            whole = len(plan.pieces) == 1 and plan.pieces[0].rank == self.rank == self.dst
            full = None if whole or self.rank != self.dst else torch.empty(plan.global_shape, dtype=wire,
                                                                           device=device)
            for piece in plan.pieces:
                if piece.rank == self.rank:
                    t = local[plan.name].tensor.detach().to(wire)
                    if whole:
                        full = t
                    elif full is not None:
                        full[_box(piece)] = t
                    else:
                        dist.send(t.contiguous(), self.dst)
                elif full is not None:
                    buf = torch.empty(piece.shape, dtype=wire, device=device)
                    dist.recv(buf, piece.rank)
                    full[_box(piece)] = buf
            if full is not None:
                yield plan.name, full.reshape(plan.full_shape)

    def state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
        """Every full tensor on `dst`, copied to the host (None elsewhere); collective."""
        out = {name: t.to("cpu", copy=True) for name, t in self.items(dtype)}
        return out if self.rank == self.dst else None

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device


def _model_order(names: list[str]) -> list[float]:
    """Where each of a rank's tensor `names` (in its state_dict order) goes in the single-process order, as sort keys:
    decoder layer i's tensors at i, those the rank lists before any layer (the embedding) first, those after any (final
    norm, output layer) last."""
    keys: list[float] = []
    for name in names:
        if name.startswith("layers."):
            keys.append(int(name.split(".")[1]))
        else:
            keys.append(float("inf") if keys and keys[-1] >= 0 else -1)
    return keys


def _box(piece: _Piece) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.shape))
