"""Reading checkpoints through the checkpointer, for trainer hosts that do not mount checkpoint.dir.

`ServiceSource` has `load.DirectorySource`'s two methods (`saved`, `newest`), and the checkpoint `newest` opens has
`load.Checkpoint`'s reading interface, so services/trainer/checkpointing.py restores from either the same way. The
checkpoint is found over gRPC (`Open`: control); a `read` asks the checkpointer's load socket on ZMQ (box_server.py:
bulk) for the box, which the service assembles from the saved pieces, whatever layout wrote them; nothing but the
rank's own pieces crosses the network.

A box larger than CHUNK_BYTES is asked for as sub-boxes of at most that size, WINDOW requests in flight at a time
(`ServiceSource.fetch`), so that the socket is not idle while the service reads the next piece and this rank copies the
last. A restore asks for all of its boxes in one `read_boxes` (services/trainer/parallel/checkpoint_shards.py
`load_shards`), whose parts share one window: a box of a few KiB does not wait for the answer to the box before it.
Answers are matched to requests by the `id` each carries (proto/checkpointer.proto). One DEALER-ROUTER connection does
deliver them in the order the service answered, and the service answers in arrival order today; the id makes that an
assumption nothing relies on, and a late answer (to a request of a fetch that failed) one that cannot be taken for
another.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Iterable, Iterator
from contextlib import closing
from typing import Any, NamedTuple, Self

import grpc
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from proto import checkpointer_pb2 as pb
from proto import checkpointer_pb2_grpc as pb_grpc
from services.checkpointer.layout import CheckpointError
from services.checkpointer.load import Box, CheckpointReader, resolve_box
from services.common import net, wire

CALL_TIMEOUT_S = 600.0  # one call: opening (verifying every checksum of a checkpoint), or waiting for one box's answer

# What one rank keeps in flight on the load socket: at most WINDOW requests of at most CHUNK_BYTES each, so 16 MiB is
# the most this rank has on its way (and the most the service holds for it), whatever the size of the box being read.
# Bytes, not a count of boxes, bound it: boxes range from a norm's few KiB to a GiB of experts. A 4 MiB answer takes
# about 3.5 ms on loopback TCP (1.2 GB/s), long against a request's own cost (a tiny box's round trip: 0.35 ms); 4 in
# flight keep one being read from the files, one on the wire and one being copied here, and a spare. On the 2-core
# development machine parts of 1-4 MiB with 2-8 in flight all read at 0.93-1.07 GB/s, 16 MiB parts at 0.67, whole
# boxes one at a time at 0.56-0.64 (bench/RESULTS.md, "Several box requests in flight").
CHUNK_BYTES = 4 << 20
WINDOW = 4


class ServiceSource:
    """The checkpoints of the checkpointer serving gRPC at `address` (its `dir` only names them in messages). Its
    channel opens at the first call and `close()` (or leaving a `with` block) closes it; a call after that opens a new
    one."""

    def __init__(self, address: str, token: str = "", dir: str = "", load: str = ""):
        """`load`: the checkpointer's load socket (its registry record's `load`); without it `newest` still answers
        but reading a box is an error."""
        self.address, self.load, self.token = address, load, token
        self.where = f"the checkpointer at {address}" + (f" (its checkpoint.dir {dir})" if dir else "")
        self.metadata = net.call_metadata(token)
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.CheckpointerStub | None = None
        self._boxes: zmq.Socket | None = None
        self._disconnects: zmq.Socket | None = None  # the load socket's monitor: tells when the service drops it
        self._ids = itertools.count(1)  # never reused, so an answer to an abandoned request can match no other

    def fetch(self, requests: Iterable[pb.LoadRequest]) -> Iterator[tuple[int, torch.Tensor]]:
        """Every request's box from the load socket, as (its index in `requests`, the box: a view of its answer's frame,
        to be copied, not kept or written; `wire.decode(copy=False)`) in the order the answers arrive, with at most
        WINDOW requests in flight (each request's `id` is set here; `requests` is iterated only as the window has
        room). A failed answer raises what a local read raises (KeyError: no such step or tensor;
        ValueError: a box outside its tensor) or a CheckpointError naming the cause, as does a service that drops the
        connection with requests unanswered or does not answer within CALL_TIMEOUT_S. Ending a fetch with requests in
        flight (an error, or the caller leaving the loop) closes the socket, so that their late answers reach no later
        fetch; the next one opens a new socket."""
        sock = self._socket()
        while self._disconnects.poll(0):  # a drop while idle lost nothing: ZMQ has reconnected or keeps trying
            recv_monitor_message(self._disconnects)
        pending: dict[int, int] = {}  # id -> index in `requests`
        ahead = iter(enumerate(requests))
        try:
            while True:
                for index, request in itertools.islice(ahead, WINDOW - len(pending)):
                    request.id = next(self._ids)
                    sock.send_multipart(wire.encode("ckpt.load", request, token=self.token), copy=False)
                    pending[request.id] = index
                if not pending:
                    return
                yield self._answer(pending)
        except GeneratorExit:  # the caller left: only requests still in flight make the socket unfit
            if pending:
                self._close_boxes()
            raise
        except BaseException:  # anything else, a send cut short included, closes it
            self._close_boxes()
            raise

    def _socket(self) -> zmq.Socket:
        if not self.load:
            raise CheckpointError(f"{self.where} registered no load socket: it cannot serve the checkpoint's tensors")
        if self._boxes is None:
            self._boxes = zmq.Context.instance().socket(zmq.DEALER)
            self._boxes.setsockopt(zmq.LINGER, 0)
            self._disconnects = self._boxes.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._boxes.connect(self.load)
        return self._boxes

    def _answer(self, pending: dict[int, int]) -> tuple[int, torch.Tensor]:
        """The next answer to one of the `pending` requests (id -> index), removed from them: (index, box)."""
        poller = zmq.Poller()
        poller.register(self._boxes, zmq.POLLIN)
        poller.register(self._disconnects, zmq.POLLIN)
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while self._boxes not in (ready := dict(poller.poll(max(0.0, deadline - time.monotonic()) * 1000))):
            if not ready:
                raise CheckpointError(f"{self.where}: its load socket {self.load} did not answer within "
                                      f"{CALL_TIMEOUT_S:.0f}s ({len(pending)} request(s) in flight); is the "
                                      "checkpointer running and reachable from here?")
            # answers that arrived before the drop are read first: the socket is polled ahead of its monitor
            if recv_monitor_message(self._disconnects)["event"] == zmq.EVENT_DISCONNECTED:
                raise CheckpointError(f"{self.where}: its load socket {self.load} closed the connection with "
                                      f"{len(pending)} request(s) unanswered; the checkpointer stopped or restarted")
        kind, reply, tensors = wire.decode(self._boxes.recv_multipart(copy=False), pb.LoadReply, copy=False)
        if kind == "ckpt.load_failed":
            errors = {"NOT_FOUND": KeyError, "INVALID_ARGUMENT": ValueError}
            raise errors.get(reply.code, CheckpointError)(reply.message)
        if kind != "ckpt.box" or len(tensors) != 1:
            raise CheckpointError(f"{self.where} answered a load with {kind!r} and {len(tensors)} tensor(s)")
        if reply.id not in pending:
            raise CheckpointError(f"{self.where} answered load request {reply.id}, which this rank is not waiting "
                                  f"for (it waits for {sorted(pending)})")
        return pending.pop(reply.id), next(iter(tensors.values()))

    def _close_boxes(self) -> None:
        if self._boxes is not None:
            self._boxes.disable_monitor()
            self._disconnects.close(linger=0)
            self._boxes.close(linger=0)
            self._boxes = self._disconnects = None

    @property
    def stub(self) -> pb_grpc.CheckpointerStub:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address)
            self._stub = pb_grpc.CheckpointerStub(self._channel)
        return self._stub

    def saved(self) -> list[str]:
        """The committed checkpoints' directory names, newest first (not verified)."""
        try:
            reply = self.stub.List(pb.ListRequest(), metadata=self.metadata, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as e:
            raise _error(e, f"{self.where}: listing checkpoints") from None
        return [c.path.rsplit("/", 1)[-1] for c in sorted(reply.checkpoints, key=lambda c: -c.step)]

    def newest(self, checksums: bool = True) -> RemoteCheckpoint | None:
        """The newest checkpoint that verifies (the service checks it, once for all ranks); None when there is none;
        CheckpointError when some are there and none verifies."""
        try:
            reply = self.stub.Open(pb.OpenRequest(checksums=checksums), metadata=self.metadata, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise _error(e, f"{self.where}: opening the newest checkpoint") from None
        return RemoteCheckpoint(self, reply)

    def close(self) -> None:
        """Closes the channel and the load socket."""
        if self._channel is not None:
            self._channel.close()
            self._channel = self._stub = None
        self._close_boxes()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RemoteCheckpoint(CheckpointReader):
    """A committed checkpoint read through a `ServiceSource`; the reading interface of `load.Checkpoint`. The source
    owns the channel: closing the checkpoint leaves it open."""

    def __init__(self, source: ServiceSource, reply: pb.DescribeReply):
        self.source = source
        self.step = reply.checkpoint.step
        self.path = f"{reply.checkpoint.path} (through the checkpointer at {source.address})"
        self.extra: dict[str, Any] = json.loads(reply.extra_json or "{}")
        self._tensors: dict[str, pb.TensorInfo] = {t.name: t for t in reply.tensors}

    def read(self, name: str, offsets: tuple[int, ...] | None = None,
             shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The box of global tensor `name` starting at `offsets` (default: origin) of `shape` (default: to the end)."""
        with closing(self.read_boxes([(name, offsets, shape)])) as boxes:
            return next(boxes)

    def read_boxes(self, boxes: Iterable[Box]) -> Iterator[torch.Tensor]:
        """Each of `boxes` ((name, offsets, shape), as `read` takes them), in order. Their parts (`_Plan`) go through
        one fetch, so the window runs across boxes: it does not drain at the end of each box, and a restore's many
        boxes of a few KiB or MiB (norms, routers, a rank's slices) keep WINDOW requests in flight as a large box's
        parts do. Every box is checked before any request (KeyError, ValueError: as `read`); a box is yielded once all
        its parts are in, so what is held besides it is at most the WINDOW parts in flight."""
        plans = [self._plan(*box) for box in boxes]
        owner = [(i, j) for i, plan in enumerate(plans) for j in range(len(plan.parts))]  # request -> (box, part)
        requests = (pb.LoadRequest(step=self.step, name=plans[i].name, offsets=plans[i].parts[j][0],
                                   shape=plans[i].parts[j][1]) for i, j in owner)
        outs: dict[int, torch.Tensor] = {}  # box -> the box, assembled as its parts arrive
        left = [len(plan.parts) for plan in plans]
        ready = 0  # the boxes before it are yielded
        with closing(self.source.fetch(requests)) as answers:
            while ready < len(plans):
                try:  # KeyError (no such tensor) and ValueError (a box outside it) pass, as a local read raises them
                    index, part = next(answers)
                except (zmq.ZMQError, wire.WireError, CheckpointError) as e:  # WireError before the ValueErrors
                    what = repr(plans[ready].name) + (f" (box {ready + 1} of {len(plans)})" if len(plans) > 1 else "")
                    raise CheckpointError(f"{self.source.where}: reading {what} of step {self.step} failed: "
                                          f"{e}") from None
                i, j = owner[index]
                self._place(outs, i, plans[i], j, part)
                left[i] -= 1
                while ready < len(plans) and left[ready] == 0:
                    yield outs.pop(ready)
                    ready += 1

    def _plan(self, name: str, offsets: tuple[int, ...] | None, shape: tuple[int, ...] | None) -> _Plan:
        lo, size = resolve_box(name, self.global_shape(name), offsets, shape)
        dtype = self.dtype(name)
        parts = split_box(lo, size, dtype.itemsize, CHUNK_BYTES)
        ends = list(itertools.accumulate(math.prod(s) * dtype.itemsize for _, s in parts))  # in the box's bytes
        return _Plan(name, dtype, size, parts, ends)

    def _place(self, outs: dict[int, torch.Tensor], i: int, plan: _Plan, j: int, part: torch.Tensor) -> None:
        """Part `j` of box `i` (planned as `plan`) copied into `outs[i]`: the one copy of its bytes on this host, from
        the frame it arrived in."""
        offsets, shape = plan.parts[j]
        if part.dtype != plan.dtype or tuple(part.shape) != shape:
            raise CheckpointError(f"{self.source.where} sent {part.dtype} {list(part.shape)} for {plan.name!r} "
                                  f"offsets={list(offsets)} shape={list(shape)} of step {self.step}, which is "
                                  f"{plan.dtype} {list(shape)}")
        if i not in outs:
            outs[i] = torch.empty(plan.size, dtype=plan.dtype)
        # One memcpy on this thread (numpy), not torch's `copy_`, which splits a copy of a few MiB over its intra-op
        # threads: with the host's cores busy (the socket's I/O thread, other ranks) that ran at 0.5 GB/s where one
        # thread copies 11.7 (the 2-core development machine, loaded).
        flat = outs[i].view(-1).view(torch.uint8).numpy()
        flat[plan.ends[j] - part.nbytes:plan.ends[j]] = part.view(-1).view(torch.uint8).numpy()


class _Plan(NamedTuple):
    """One box of a `read_boxes`: its parts (`split_box`) and where each part's bytes end in the box."""
    name: str
    dtype: torch.dtype
    size: tuple[int, ...]
    parts: list[tuple[tuple[int, ...], tuple[int, ...]]]
    ends: list[int]


def split_box(offsets: tuple[int, ...], shape: tuple[int, ...], itemsize: int,
              limit: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The box (`offsets`, `shape`) as sub-boxes of at most `limit` bytes (`itemsize` each element), in the box's C
    order: each is one contiguous run of the box's elements, and together they tile it end to end."""
    if math.prod(shape) * itemsize <= limit:
        return [(tuple(offsets), tuple(shape))]
    row = math.prod(shape[1:]) * itemsize  # the bytes of one index of the first dimension
    if row <= limit:
        n = limit // row
        return [((offsets[0] + i, *offsets[1:]), (min(n, shape[0] - i), *shape[1:])) for i in range(0, shape[0], n)]
    return [((offsets[0] + i, *o), (1, *s)) for i in range(shape[0])
            for o, s in split_box(offsets[1:], shape[1:], itemsize, limit)]


def _error(e: grpc.RpcError, what: str) -> CheckpointError:
    """A CheckpointError naming the service's status: the service unreachable or token-less, no checkpoint that
    verifies."""
    code, details = e.code(), e.details()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return CheckpointError(f"{what} failed: the service did not answer ({code.name}: {details}); is the "
                               "checkpointer running and its address reachable from this host?")
    return CheckpointError(f"{what} failed ({code.name}: {details})")
