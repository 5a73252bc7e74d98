"""Reading checkpoints through the checkpointer, for trainer hosts that do not mount checkpoint.dir.

`ServiceSource` has `load.DirectorySource`'s two methods (`saved`, `newest`), and the checkpoint `newest` opens has
`load.Checkpoint`'s reading interface, so services/trainer/checkpointing.py restores from either the same way. The
checkpoint is found over gRPC (`Open`: control); each `read` is one request to the checkpointer's load socket on ZMQ
(box_server.py: bulk), which assembles the box from the saved pieces, whatever layout wrote them, and sends its bytes
as one frame; nothing but the rank's own pieces crosses the network.
"""

from __future__ import annotations

import json
from typing import Any, Self

import grpc
import torch
import zmq

from proto import checkpointer_pb2 as pb
from proto import checkpointer_pb2_grpc as pb_grpc
from services.checkpointer.layout import CheckpointError
from services.checkpointer.load import CheckpointReader, resolve_box
from services.common import net, wire

CALL_TIMEOUT_S = 600.0  # one call: opening (verifying every checksum of a checkpoint) or reading one tensor's box


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

    def request_box(self, request: pb.LoadRequest) -> torch.Tensor:
        """One box from the load socket. A request that fails or times out closes the socket, so that a late answer
        can never be taken for the next request's."""
        if not self.load:
            raise CheckpointError(f"{self.where} registered no load socket: it cannot serve the checkpoint's tensors")
        if self._boxes is None:
            self._boxes = zmq.Context.instance().socket(zmq.DEALER)
            self._boxes.setsockopt(zmq.LINGER, 0)
            self._boxes.connect(self.load)
        try:
            self._boxes.send_multipart(wire.encode("ckpt.load", request, token=self.token), copy=False)
            if not self._boxes.poll(int(CALL_TIMEOUT_S * 1000)):
                raise CheckpointError(f"{self.where}: its load socket {self.load} did not answer within "
                                      f"{CALL_TIMEOUT_S:.0f}s; is the checkpointer running and reachable from here?")
            kind, failed, tensors = wire.decode(self._boxes.recv_multipart(copy=False), pb.LoadFailed)
        except BaseException:
            self._close_boxes()
            raise
        if kind == "ckpt.box" and len(tensors) == 1:
            return next(iter(tensors.values()))
        if kind == "ckpt.load_failed":
            errors = {"NOT_FOUND": KeyError, "INVALID_ARGUMENT": ValueError}
            raise errors.get(failed.code, CheckpointError)(failed.message)
        raise CheckpointError(f"{self.where} answered a load with {kind!r}")

    def _close_boxes(self) -> None:
        if self._boxes is not None:
            self._boxes.close(linger=0)
            self._boxes = None

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
        lo, size = resolve_box(name, self.global_shape(name), offsets, shape)
        request = pb.LoadRequest(step=self.step, name=name, offsets=lo, shape=size)
        try:  # KeyError (no such tensor) and ValueError (a box outside it) pass, as a local read raises them
            box = self.source.request_box(request)
        except (zmq.ZMQError, wire.WireError, CheckpointError) as e:  # WireError before the ValueErrors that pass
            raise CheckpointError(f"{self.source.where}: reading {name!r} of step {self.step} failed: {e}") from None
        if box.dtype != self.dtype(name) or tuple(box.shape) != tuple(size):
            raise CheckpointError(f"{self.source.where} sent {box.dtype} {list(box.shape)} for {name!r} "
                                  f"offsets={list(lo)} shape={list(size)} of step {self.step}, which is "
                                  f"{self.dtype(name)} {list(size)}")
        return box


def _error(e: grpc.RpcError, what: str) -> CheckpointError:
    """A CheckpointError naming the service's status: the service unreachable or token-less, no checkpoint that
    verifies."""
    code, details = e.code(), e.details()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return CheckpointError(f"{what} failed: the service did not answer ({code.name}: {details}); is the "
                               "checkpointer running and its address reachable from this host?")
    return CheckpointError(f"{what} failed ({code.name}: {details})")
