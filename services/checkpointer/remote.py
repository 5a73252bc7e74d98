"""Reading checkpoints through the checkpointer's gRPC service, for trainer hosts that do not mount checkpoint.dir.

`ServiceSource` has `load.DirectorySource`'s two methods (`saved`, `newest`), and the checkpoint `newest` opens has
`load.Checkpoint`'s reading interface, so services/trainer/checkpointing.py restores from either the same way. Each
`read` is one `Load` call: the service assembles the box from the saved pieces, whatever layout wrote them, and streams
its bytes; nothing but the rank's own pieces crosses the network.
"""

from __future__ import annotations

import json
from typing import Any, Self

import grpc
import numpy as np
import torch

from proto import checkpointer_pb2 as pb
from proto import checkpointer_pb2_grpc as pb_grpc
from services.checkpointer.layout import CheckpointError
from services.checkpointer.load import CheckpointReader, resolve_box
from services.common import net

CALL_TIMEOUT_S = 600.0  # one call: opening (verifying every checksum of a checkpoint) or streaming one tensor's box


class ServiceSource:
    """The checkpoints of the checkpointer serving gRPC at `address` (its `dir` only names them in messages). Its
    channel opens at the first call and `close()` (or leaving a `with` block) closes it; a call after that opens a new
    one."""

    def __init__(self, address: str, token: str = "", dir: str = ""):
        self.address = address
        self.where = f"the checkpointer at {address}" + (f" (its checkpoint.dir {dir})" if dir else "")
        self.metadata = net.call_metadata(token)
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.CheckpointerStub | None = None

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
        """Closes the channel: a stream still reading through it is cancelled."""
        if self._channel is not None:
            self._channel.close()
            self._channel = self._stub = None

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
        out = torch.empty(size, dtype=self.dtype(name))
        dest = out.reshape(-1).view(torch.uint8).numpy()
        request = pb.LoadRequest(step=self.step, name=name, offsets=lo, shape=size)
        got = 0  # bytes received: a service that sends more or fewer than the box is an error, not a short read
        try:
            for chunk in self.source.stub.Load(request, metadata=self.source.metadata, timeout=CALL_TIMEOUT_S):
                n = len(chunk.data)
                if got + n <= dest.size:
                    dest[got:got + n] = np.frombuffer(chunk.data, dtype=np.uint8)
                got += n
        except grpc.RpcError as e:
            raise _error(e, f"{self.source.where}: reading {name!r} of step {self.step}") from None
        if got != dest.size:
            raise CheckpointError(f"{self.source.where} sent {got} bytes for {name!r} offsets={list(lo)} "
                                  f"shape={list(size)} of step {self.step}, which is {dest.size} bytes")
        return out


def _error(e: grpc.RpcError, what: str) -> Exception:
    """ValueError for a box outside its tensor (as a local read raises); CheckpointError naming the service's status
    for anything else: the service unreachable, a corrupt file, no checkpoint that verifies, one deleted meanwhile."""
    code, details = e.code(), e.details()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(details)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return CheckpointError(f"{what} failed: the service did not answer ({code.name}: {details}); is the "
                               "checkpointer running and its address reachable from this host?")
    return CheckpointError(f"{what} failed ({code.name}: {details})")
