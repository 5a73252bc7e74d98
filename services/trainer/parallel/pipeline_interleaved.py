"""Interleaved 1F1B (virtual pipeline stages, `parallel.pp_virtual`; Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", §2.2): each of the P pipeline ranks holds V model chunks,
so a micro-batch crosses the ranks V times and the pipeline's fill and drain (the bubble) shrink to 1/V of plain 1F1B's.

Layout (`pipeline.rank_chunks`): the layers are cut into P·V chunks in model order and rank r holds chunks r, r+P, ...,
its local chunks 0..V-1. Chunk c feeds chunk c+1 on the next rank, so hidden states travel on a ring: between chunks
kP-1 and kP the last rank sends forward to rank 0, and rank 0 sends gradients backward to the last rank.

Order. Units (micro-batches, or pairs under `parallel.ep_overlap`) go in groups of at least P (`unit_groups`): forwards
group by group, within a group chunk by chunk (0..V-1), within a chunk the group's units; backwards the same with the
chunks V-1..0. While a group's first unit goes once round the ring (P chunk forwards), rank 0 forwards the group's other
units through the same chunk, so no rank waits in the steady state. Groups are evened out instead of leaving a short
last group, whose units would each wait a whole round.

Ticks. The schedule advances in ticks. In each tick a rank runs its next forward, if its input has arrived, then its
next backward, if its gradient has arrived (or it is the model's last chunk, whose forward ran), and then exchanges
with its neighbours, in one `batch_isend_irecv`, the outputs of this tick's work and the inputs of later work. `plan`
simulates that for every rank at once (a pure function of P, V and the number of units), so each rank knows for every
tick what it runs and what it sends to and receives from whom, and what every other rank does.

Why it cannot deadlock: each transfer is posted by its sender and by its receiver in the same tick, and the transfers
between two ranks are listed by both in one order. A tick's work reads only tensors received in earlier ticks. So, by
induction over ticks: once every rank has finished tick t-1, each computes its tick-t work and posts its tick-t
exchange, in which every send and receive finds its partner posted. On NCCL a batch is one group (its sends and
receives progress together) and a pair of ranks' sends and receives match in posting order; on gloo, in order too.
All ranks of a stage (TP/CP/EP/DP peers) compute the same table, so their in-layer collectives run in the same order.
Should the simulation ever stop making progress it raises before any transfer (tests/test_parallel_pp_interleaved.py
checks that it does not for P <= 8, V <= 5, unit counts 1..3P+1 and two larger ones; it did not for P <= 16, V <= 8,
unit counts 1..4P+2 and three larger ones either).

Memory. With one forward and one backward per tick, a rank runs ahead of its backwards by the forwards that fit in
before its first gradient comes back round the ring, then keeps that distance: at most (V-1)·G + 2(P-1-r) + 1 chunk
activations, G the largest group (tests check the bound on every plan they build). That is Megatron-LM's warm-up (+1)
when G = P (a unit count that is a multiple of P): P + (P-1)/V stages' worth on rank 0, against P for plain 1F1B;
with groups of up to 2P-1 units (other counts), up to 2P-1 stages' worth.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from services.trainer.parallel.pipeline import StageLink, UnitForward, _StageRunner


@dataclass(frozen=True)
class Work:
    """One unit through one of a rank's chunks, forward or backward."""

    backward: bool
    unit: int
    chunk: int  # the chunk's index on the rank that runs it (0..V-1)


@dataclass(frozen=True)
class Transfer:
    """A unit's hidden states (forward) or their gradient (backward), from pp rank `src` to pp rank `dst`."""

    src: int
    dst: int
    made_by: Work  # the work on `src` whose output it is
    needed_by: Work  # the work on `dst` that reads it


@dataclass
class Tick:
    """What one rank does in one tick: its work (a forward, then a backward, either may be missing), then one exchange
    of `transfers` (its sends and receives, in the order both ends post them)."""

    work: list[Work] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)


def unit_groups(pp: int, units: int) -> list[range]:
    """`units` split into as many groups of at least `pp` consecutive units as fit, sizes as even as possible (one
    group of all units when there are fewer than `pp`)."""
    n = max(1, units // pp)
    base, extra = divmod(units, n)
    starts = [g * base + min(g, extra) for g in range(n + 1)]
    return [range(starts[g], starts[g + 1]) for g in range(n)]


def _receiver(pp: int, virtual: int, rank: int, work: Work) -> tuple[int, Work] | None:
    """The rank and work that read `work`'s output; None for the model's last chunk forward and first chunk backward."""
    chunk = work.chunk * pp + rank  # global chunk index
    to = chunk - 1 if work.backward else chunk + 1
    if not 0 <= to < pp * virtual:
        return None
    return to % pp, Work(work.backward, work.unit, to // pp)


@functools.cache
def plan(pp: int, virtual: int, units: int, backward: bool = True) -> tuple[tuple[Tick, ...], ...]:
    """Every rank's ticks (see the module docstring): plan(...)[rank][t]. Without `backward`, forwards only (for
    forward-only passes)."""
    groups = unit_groups(pp, units)
    forwards = [Work(False, u, k) for g in groups for k in range(virtual) for u in g]
    backwards = [Work(True, u, k) for g in groups for k in reversed(range(virtual)) for u in g] if backward else []
    position = {w: n for n, w in enumerate(forwards)}
    next_f, next_b = [0] * pp, [0] * pp
    arrived: list[set[Work]] = [set() for _ in range(pp)]  # work whose input or gradient has been received
    ticks: list[list[Tick]] = [[] for _ in range(pp)]
    while any(next_f[r] < len(forwards) or next_b[r] < len(backwards) for r in range(pp)):
        now = [Tick() for _ in range(pp)]
        for r in range(pp):
            if next_f[r] < len(forwards):
                w = forwards[next_f[r]]
                if (w.chunk == 0 and r == 0) or w in arrived[r]:
                    now[r].work.append(w)
                    next_f[r] += 1
            if next_b[r] < len(backwards):
                w = backwards[next_b[r]]
                forward_ran = position[Work(False, w.unit, w.chunk)] < next_f[r]
                if forward_ran and (w in arrived[r] or (r == pp - 1 and w.chunk == virtual - 1)):
                    now[r].work.append(w)
                    next_b[r] += 1
        if not any(t.work for t in now):
            raise RuntimeError(f"the interleaved 1F1B plan for pp={pp}, pp_virtual={virtual}, {units} units stalls "
                               "(a bug in pipeline_interleaved.plan)")
        for r in range(pp):  # transfers in one global order: both ends list them alike
            for w in now[r].work:
                if (to := _receiver(pp, virtual, r, w)) is not None:
                    transfer = Transfer(r, to[0], w, to[1])
                    now[r].transfers.append(transfer)
                    now[to[0]].transfers.append(transfer)
                    arrived[to[0]].add(to[1])  # readable from the next tick on
        for r in range(pp):
            ticks[r].append(now[r])
    return tuple(tuple(t) for t in ticks)


def _exchange(link: StageLink, tick: Tick, units: list[list[int]], outputs: dict[Work, list[torch.Tensor]],
              inbox: dict[Work, list[torch.Tensor]]) -> None:
    """The tick's transfers in one exchange: sends of this tick's outputs, receives (into `inbox`) of later work's
    inputs. Forward goes to the next rank on the ring, backward to the previous one."""
    send, recv = [], []
    for t in tick.transfers:
        if t.src == link.rank:
            send += [(x, -1 if t.made_by.backward else +1) for x in outputs[t.made_by]]
        else:
            inbox[t.needed_by] = link.buffers(units[t.needed_by.unit])
            recv += [(b, +1 if t.needed_by.backward else -1) for b in inbox[t.needed_by]]
    link.exchange(send, recv)


def interleaved_forward_backward(run: _StageRunner, link: StageLink, units: list[list[int]]) -> None:
    """Forward and backward of every unit through this rank's chunks, tick by tick (`plan`); `run` keeps the
    activations and the loss (pipeline.one_f_one_b's runner)."""
    inbox: dict[Work, list[torch.Tensor]] = {}
    for tick in plan(link.size, link.virtual, len(units))[link.rank]:
        outputs = {}
        for w in tick.work:
            step = run.backward if w.backward else run.forward
            outputs[w] = step(units[w.unit], inbox.pop(w, None), w.chunk)
        _exchange(link, tick, units, outputs, inbox)


def interleaved_forward_only(unit_forward: UnitForward, link: StageLink, units: list[list[int]]
                             ) -> list[torch.Tensor | None]:
    """`pipeline.forward_only` with virtual stages: every unit (a micro-batch, or a pair under `parallel.ep_overlap`)
    forward through every chunk without autograd, in the interleaved order; the model's last chunk's outputs on the
    last rank, by micro-batch, None elsewhere."""
    outs: list[torch.Tensor | None] = [None] * len(link.tokens)
    inbox: dict[Work, list[torch.Tensor]] = {}
    with torch.no_grad():
        for tick in plan(link.size, link.virtual, len(units), backward=False)[link.rank]:
            outputs = {}
            for w in tick.work:
                unit = units[w.unit]
                results = unit_forward(unit, inbox.pop(w, [None] * len(unit)), w.chunk)
                if link.holds_loss(w.chunk):
                    for i, out in zip(unit, results, strict=True):
                        outs[i] = out
                else:
                    outputs[w] = [out.contiguous() for out in results]
            _exchange(link, tick, units, outputs, inbox)
    return outs
