"""The checkpointer's gRPC face: standard health plus the `Checkpointer` service (status, list, describe, delete, keep)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import grpc

from proto import checkpointer_pb2 as pb
from proto import checkpointer_pb2_grpc as pb_grpc
from services.checkpointer.layout import CheckpointError
from services.checkpointer.store import CheckpointStore, CheckpointSummary
from services.common import grpc_server, net

if TYPE_CHECKING:
    from services.checkpointer.writer import Writer

SERVICE_NAME = "foldmoe.v1.Checkpointer"


def _info(s: CheckpointSummary) -> pb.CheckpointInfo:
    return pb.CheckpointInfo(step=s.step, path=str(s.path), keep=s.keep, latest=s.latest, bytes=s.bytes,
                             world_size=s.world_size, valid=s.valid, problem=s.problem)


class CheckpointerServicer(pb_grpc.CheckpointerServicer):
    def __init__(self, store: CheckpointStore, writer: Writer):
        self.store, self.writer = store, writer

    def _step(self, step: int, context: grpc.ServicerContext) -> int:
        if step >= 0:
            return step
        latest = self.store.latest_step()
        if latest < 0:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no checkpoint in {self.store.root} yet")
        return latest

    def SaveStatus(self, request, context):
        return self.writer.status()

    def List(self, request, context):
        return pb.ListReply(checkpoints=[_info(s) for s in self.store.list(checksums=request.verify)])

    def Describe(self, request, context):
        step = self._step(request.step, context)
        try:
            summary = self.store.summary(step)
            manifest = self.store.manifest(step)
        except CheckpointError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        tensors = [pb.TensorInfo(name=n, dtype=e.dtype, global_shape=list(e.global_shape), num_shards=len(e.boxes))
                   for n, e in sorted(manifest.tensors.items())]
        extra = manifest.extras[0] if manifest.extras else {}
        return pb.DescribeReply(checkpoint=_info(summary), tensors=tensors, extra_json=json.dumps(extra))

    def Delete(self, request, context):
        deleted = self.store.delete(request.step)
        return pb.DeleteReply(deleted=deleted, latest_step=self.store.latest_step())

    def Keep(self, request, context):
        try:
            return pb.KeepReply(checkpoint=_info(self.store.set_keep(request.step, request.keep)))
        except CheckpointError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))


def serve_grpc(store: CheckpointStore, writer: Writer, host: str = "127.0.0.1", advertise: str = "",
               token: str = "") -> tuple[grpc.Server, str]:
    """Start the gRPC server on a free port of `host`; returns (server, the "host:port" clients dial)."""
    server, port = grpc_server.serve([lambda s: pb_grpc.add_CheckpointerServicer_to_server(
        CheckpointerServicer(store, writer), s)], [SERVICE_NAME], host=host, max_workers=4, token=token)
    return server, f"{net.advertised(host, advertise)}:{port}"
