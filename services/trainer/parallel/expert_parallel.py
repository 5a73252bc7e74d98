"""Expert parallelism (EP) and expert tensor parallelism (ETP), applied to the single-device MoE layers.

Each rank of an EP×ETP group (`groups.ep_etp`: the ranks that together hold every expert once) keeps E/ep experts and,
with ETP, a 1/etp slice of each expert's FFN width: the gate and up columns [t·f/etp, (t+1)·f/etp) of `w13` and the same
rows of `w2`. SwiGLU is elementwise in the FFN dimension and the router weight is folded in before `w2`, so the ETP
ranks' outputs are partial sums of the expert output: the way back sums them.

Two dispatchers implement the `LocalDispatcher` interface (`dispatch(hidden, routing) -> Dispatched`, `combine`), so
the MoE layer itself is unchanged:
- `AllToAllDispatcher`: permute by expert, exchange per-expert counts, all-to-all the rows (and their router weights)
  to the ranks holding their expert — once to every ETP rank of that expert —, regroup by local expert, and reverse it
  all on the way back, summing the ETP partials. Traffic ∝ routed tokens.
- `AllGatherDispatcher`: all-gather every rank's tokens and routing over EP×ETP, each rank computes the slots routed
  to its experts, and a reduce-scatter brings each token's summed output home. Simpler and better when k·T is large
  relative to T·ep (small EP, many active experts).
Routing, including the capacity drop decision, is made by the router on the rank's own tokens before dispatch, so
which slots survive does not depend on the expert layout.

With `model.pad_to_capacity` the all-to-all sends every expert exactly its capacity of rows (`permute_padded`), so the
split sizes are known on the host before anything runs: each rank receives capacity rows per local expert from each
EP×ETP peer, and the per-expert counts are neither exchanged nor read back. That holds when the peers' micro-batches
have as many tokens each (the same capacity): packed pre-training micro-batches do; dynamic CP is refused by the config.
The all-gather dispatcher does not pad (it reads the peers' token counts to size its gather anyway; refused by the
config).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from services.trainer.model.moe.dispatcher import (Dispatched, permute, permute_by_expert, unpermute,
                                                   unpermute_by_token)
from services.trainer.model.moe.experts import GroupedExperts
from services.trainer.model.moe.moe_layer import MoELayer
from services.trainer.model.moe.router import Routing
from services.trainer.model.stages import Stages, run_to_end
from services.trainer.parallel.differentiable import all_gather_dim0, gather_tokens, reduce_scatter_tokens
from services.trainer.parallel.groups import Axis, ParallelGroups

# ---------------------------------------------------------------- all-to-all with its autograd dual

# An all-to-all split in two autograd nodes, so that work placed between them overlaps the transfer in both passes:
# forward launches at `_Launch` and waits at `_Land`; backward launches the gradient's transfer at `_Land` and waits at
# `_Launch`. Autograd runs backward nodes in reverse creation order, so what ran between the two in forward (the
# shared expert; another micro-batch's layers under `parallel.ep_overlap`) runs between them in backward too. Every
# rank builds the same graph, so the collectives match.


class _Flight:
    """The transfer in flight between a `_Launch` and its `_Land`: its handle, and in backward its output."""

    work = None
    grad: torch.Tensor | None = None


class _Launch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group, flight: _Flight):
        ctx.flight = flight
        out = x.new_empty((sum(recv), *x.shape[1:]))
        flight.work = dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send,
                                             group=group, async_op=True)
        return out  # not valid until `_Land` waits

    @staticmethod
    def backward(ctx, _):
        flight = ctx.flight  # the incoming gradient is `_Land`'s placeholder: the real one is in flight
        flight.work.wait()  # the gradient's transfer, launched by `_Land.backward`
        grad, flight.grad, flight.work = flight.grad, None, None
        return grad, None, None, None, None


class _Land(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, send: list[int], recv: list[int], group, flight: _Flight):
        ctx.send, ctx.recv, ctx.group, ctx.flight = send, recv, group, flight
        flight.work.wait()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        flight = ctx.flight
        flight.grad = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        flight.work = dist.all_to_all_single(flight.grad, grad.contiguous(), output_split_sizes=ctx.send,
                                             input_split_sizes=ctx.recv, group=ctx.group, async_op=True)
        # Autograd wants a gradient shaped like this node's input; `_Launch.backward` returns the transferred one.
        return grad, None, None, None, None


class _CountsToHost:
    """The per-expert counts exchange, and their copy to the host, started without waiting: `wait()` then blocks the
    host only until this exchange and copy are done (a CUDA event), not until everything queued after them is."""

    def __init__(self, send_counts: torch.Tensor, recv_counts: torch.Tensor, group):
        work = dist.all_to_all_single(recv_counts, send_counts, group=group, async_op=True)
        self.event = None
        if send_counts.is_cuda:
            work.wait()  # the current stream waits for the exchange; the host does not
            self.host = torch.empty((2, *send_counts.shape), dtype=send_counts.dtype, pin_memory=True)
            self.host.copy_(torch.stack([send_counts, recv_counts]), non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.work, self.pair = work, (send_counts, recv_counts)

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(send, recv) counts on the host."""
        if self.event is not None:
            self.event.synchronize()
        else:
            self.work.wait()
            self.host = torch.stack(self.pair)
        self.send, self.recv = self.host[0], self.host[1]
        return self.send, self.recv


class _CountsKnown:
    """Pad-to-capacity: every peer sends `capacity` rows per expert, so the (send, recv) counts are known here."""

    def __init__(self, peers: int, local_experts: int, capacity: int):
        self.send = self.recv = torch.full((peers, local_experts), capacity, dtype=torch.int64)

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.send, self.recv


# ---------------------------------------------------------------- dispatchers


class _RowOrder(torch.autograd.Function):
    """x[index] for a permutation `index` of x's rows whose inverse is `inverse`. Backward gathers the gradient by
    the inverse: indexing's own backward scatters it with an accumulating index_put, which sorts the indices first
    (4.6 ms per DP2·EP2 step of the 4-layer Qwen3 shape in a trace on H200s, bench/RESULTS.md)."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x[index]

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad[inverse], None, None


class AllToAllDispatcher:
    def __init__(self, num_experts: int, axis: Axis, ep: int, etp: int, fused: bool = False):
        self.num_experts, self.ep, self.etp, self.axis = num_experts, ep, etp, axis
        self.local_experts = num_experts // ep
        self.fused = fused  # the Triton permutation where it applies (model.moe_kernels: [permutation])

    def dispatch(self, hidden: torch.Tensor, routing: Routing, in_flight=None) -> Dispatched:
        return run_to_end(self.dispatch_stages(hidden, routing, in_flight))

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        return run_to_end(self.combine_stages(expert_out, dispatched))

    def dispatch_stages(self, hidden: torch.Tensor, routing: Routing, in_flight=None) -> Stages[Dispatched]:
        """`in_flight()` (the shared expert) runs while the tokens travel, in forward and in backward; then the
        forward pauses (services/trainer/model/stages.py) until resumed, so another micro-batch may compute too."""
        padded = routing.capacity is not None
        # Rows grouped by expert are grouped by the EP rank holding it: the send order. The Triton permutation keeps
        # zero rows for dropped copies past the last expert's; they are not sent.
        x, w, counts, undo = permute_by_expert(hidden, routing, self.num_experts, self.fused)
        El, peers = self.local_experts, self.axis.size
        # Group rank = ep_rank * etp + etp_rank (ETP innermost), so each EP rank's expert block goes to its etp ranks.
        send_counts = counts.view(self.ep, El).repeat_interleave(self.etp, dim=0)  # [peers, El]
        if padded:  # the peers send what this rank sends: capacity rows per expert; no exchange
            recv_counts, counts_on_host = send_counts, _CountsKnown(peers, El, routing.capacity)
        else:
            recv_counts = torch.empty_like(send_counts)
            counts_on_host = _CountsToHost(send_counts, recv_counts, self.axis.group)
        # all_to_all_single takes its split sizes as host ints: the dispatch's one device->host sync (none when padded).
        # Pause first, so that another micro-batch can queue work for the GPU to run while this host thread waits.
        yield
        send_host, recv_host = counts_on_host.wait()  # [peers, El] each
        send, recv = send_host.sum(1).tolist(), recv_host.sum(1).tolist()
        permuted_rows = x.shape[0]
        x, w = x[:sum(send[::self.etp])], w[:sum(send[::self.etp])]
        dup = None
        if self.etp > 1:  # each EP block's rows are sent once per ETP rank of that block
            starts = [0] + counts_on_host.send[::self.etp].sum(1).cumsum(0).tolist()
            dup = torch.cat([torch.arange(starts[j], starts[j + 1], device=x.device)
                             for j in range(self.ep) for _ in range(self.etp)])
            x, w = x[dup], w[dup]
        flights = _Flight(), _Flight()
        x = _Launch.apply(x, send, recv, self.axis.group, flights[0])
        w = _Launch.apply(w, send, recv, self.axis.group, flights[1])
        if in_flight is not None:
            in_flight()
        yield
        x = _Land.apply(x, send, recv, self.axis.group, flights[0])
        w = _Land.apply(w, send, recv, self.axis.group, flights[1])
        # Received rows are grouped by source rank, then by local expert; the experts want them by local expert.
        expert_of_row = torch.arange(El, device=x.device).repeat(peers).repeat_interleave(
            recv_counts.reshape(-1), output_size=sum(recv))  # the size given: no device->host sync
        order = torch.sort(expert_of_row, stable=True).indices
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))
        state = (order, inverse, dup, send, recv, undo, permuted_rows)
        return Dispatched(_RowOrder.apply(x, order, inverse), _RowOrder.apply(w, order, inverse),
                          recv_counts.sum(0), state)

    def combine_stages(self, expert_out: torch.Tensor, dispatched: Dispatched) -> Stages[torch.Tensor]:
        """The way back; pauses while the expert outputs travel."""
        order, inverse, dup, send, recv, undo, permuted_rows = dispatched.state
        by_source = _RowOrder.apply(expert_out, inverse, order)
        flight = _Flight()
        back = _Launch.apply(by_source, recv, send, self.axis.group, flight)
        yield
        back = _Land.apply(back, recv, send, self.axis.group, flight)
        if dup is not None:  # sum the ETP partial outputs of each row
            back = back.new_zeros(sum(send[::self.etp]), back.shape[1]).index_add(0, dup, back)
        back = F.pad(back, (0, 0, 0, permuted_rows - back.shape[0]))  # the dropped copies' zero rows, if any
        return unpermute_by_token(back, undo)


class AllGatherDispatcher:
    def __init__(self, num_experts: int, axis: Axis, ep_rank: int, ep: int):
        self.num_experts, self.axis = num_experts, axis
        self.local_experts = num_experts // ep
        self.first_expert = ep_rank * self.local_experts

    def dispatch(self, hidden: torch.Tensor, routing: Routing, in_flight=None) -> Dispatched:
        T, group = hidden.shape[0], self.axis.group
        if in_flight is not None:  # the all-gathers below are synchronous: nothing to overlap with
            in_flight()
        # Ranks may hold different token counts (dynamic CP): pad to the largest so one all-gather carries them all.
        # Its size is needed on the host to allocate the buffer.
        sizes = all_gather_dim0(torch.tensor([T], device=hidden.device), group).tolist()
        pad = max(sizes) - T
        kept = routing.kept if routing.kept is not None else torch.ones_like(routing.expert_ids, dtype=torch.bool)
        x_all = gather_tokens(F.pad(hidden, (0, 0, 0, pad)), group)
        w_all = gather_tokens(F.pad(routing.weights, (0, 0, 0, pad)), group)
        ids_all = all_gather_dim0(F.pad(routing.expert_ids, (0, 0, 0, pad)), group)
        kept_all = all_gather_dim0(F.pad(kept.to(torch.uint8), (0, 0, 0, pad)), group).bool()
        local_ids = ids_all - self.first_expert
        mine = kept_all & (local_ids >= 0) & (local_ids < self.local_experts)
        local = Routing(local_ids.clamp(0, self.local_experts - 1), w_all, mine, routing.aux_loss)
        x, w, counts, token_idx = permute(x_all, local, self.local_experts)
        return Dispatched(x, w, counts, (token_idx, x_all.shape[0], T))

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        token_idx, num_gathered, num_tokens = dispatched.state
        partial_sums = unpermute(expert_out, token_idx, num_gathered)  # this rank's experts (and FFN slice) only
        return reduce_scatter_tokens(partial_sums, self.axis.group)[:num_tokens]


# ---------------------------------------------------------------- sharding the experts


def shard_experts(experts: GroupedExperts, ep_rank: int, ep: int, etp_rank: int, etp: int) -> None:
    """Keep experts [ep_rank·E/ep, …) and the FFN slice etp_rank of each, in place. Tags each parameter with
    `expert_box`: (global shape, offsets) in the [E, h, 2, f] view of w13 and the [E, f, h] of w2."""
    E, h, f2 = experts.w13.shape
    f = f2 // 2
    if E % ep or f % etp:
        raise ValueError(f"ep={ep} must divide num_experts={E} and etp={etp} the expert FFN width {f}")
    El, fl = E // ep, f // etp
    e, c = slice(ep_rank * El, (ep_rank + 1) * El), slice(etp_rank * fl, (etp_rank + 1) * fl)
    gate, up = experts.w13.detach()[e, :, :f], experts.w13.detach()[e, :, f:]
    w13 = nn.Parameter(torch.cat([gate[..., c], up[..., c]], dim=-1).contiguous())
    w2 = nn.Parameter(experts.w2.detach()[e, c, :].contiguous())
    w13.expert_box = ((E, h, 2, f), (ep_rank * El, 0, 0, etp_rank * fl))
    w2.expert_box = ((E, f, h), (ep_rank * El, etp_rank * fl, 0))
    experts.w13, experts.w2 = w13, w2
    experts.num_experts = El


def expert_box_view(p: torch.Tensor) -> torch.Tensor:
    """The local piece of an expert parameter shaped as its box (w13 seen as [El, h, 2, f/etp])."""
    global_shape, _ = p.expert_box
    return p.view(p.shape[0], p.shape[1], 2, -1) if len(global_shape) == 4 else p


def full_expert_tensor(pieces: list[tuple[torch.Tensor, tuple]], global_shape: tuple[int, ...]) -> torch.Tensor:
    """Reassemble a full expert tensor in the single-device layout from (box piece, offsets) pairs (tests, export)."""
    out = pieces[0][0].new_zeros(global_shape)
    for piece, offsets in pieces:
        out[tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape))] = piece
    return out.reshape(global_shape[0], global_shape[1], -1) if len(global_shape) == 4 else out


def apply_expert_parallel(model: nn.Module, groups: ParallelGroups, dispatcher: str = "alltoall") -> nn.Module:
    """Shard every MoE layer's experts over EP×ETP and swap in the EP dispatcher. Call on the full-weight model (after
    `init_weights`), so every layout starts from the single-device weights."""
    ep, etp = groups.ep, groups.etp
    if ep.size * etp.size == 1:
        return model
    for moe in (m for m in model.modules() if isinstance(m, MoELayer)):
        E = moe.experts.w13.shape[0]
        shard_experts(moe.experts, ep.rank, ep.size, etp.rank, etp.size)
        if dispatcher == "alltoall":
            moe.dispatcher = AllToAllDispatcher(E, groups.ep_etp, ep.size, etp.size, fused=moe.dispatcher.fused)
        elif dispatcher == "allgather":
            moe.dispatcher = AllGatherDispatcher(E, groups.ep_etp, ep.rank, ep.size)
        else:
            raise ValueError(f"`parallel.dispatcher={dispatcher!r}` is not one of 'alltoall', 'allgather'")
    model.expert_parallel = (ep.size, etp.size)
    return model


def is_expert_param(name: str, p: torch.Tensor) -> bool:
    """Routed-expert weights: reduced over EDP, not DP×CP. Identified by the layer they belong to, sharded or not."""
    return hasattr(p, "expert_box") or name.endswith(("experts.w13", "experts.w2"))


def bind_router_replicas(model: nn.Module, groups: ParallelGroups) -> None:
    """Give every router of a global aux loss the data-parallel group, over which it sums its counts (router.py);
    other routers hold no group they do not use (a `copy.deepcopy` of the model needs none shared)."""
    for moe in (m for m in model.modules() if isinstance(m, MoELayer)):
        if moe.router.cfg.aux_loss_type == "global":
            moe.router.dp_group = groups.dp.group


@torch.no_grad()
def sync_expert_load(model: nn.Module, groups: ParallelGroups) -> None:
    """Sum every router's `tokens_per_expert` over all ranks of this stage (TP shards × DP×CP replicas) so the
    aux-loss-free bias update sees the global load and leaves the bias identical on every rank."""
    routers = [m.router for m in model.modules() if isinstance(m, MoELayer)]
    if not routers:
        return
    load = torch.stack([r.tokens_per_expert for r in routers])
    for axis in (groups.tp, groups.dp_cp):
        if axis.size > 1:
            dist.all_reduce(load, group=axis.group)
    for r, row in zip(routers, load):
        r.tokens_per_expert.copy_(row)

