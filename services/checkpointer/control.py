"""The checkpointer's gRPC face: standard health plus the `Checkpointer` service (status, list, describe, delete, keep)."""

from __future__ import annotations

import json
from concurrent import futures
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from proto import checkpointer_pb2 as pb
from proto import checkpointer_pb2_grpc as pb_grpc
from services.checkpointer.layout import CheckpointError
from services.checkpointer.store import CheckpointStore, CheckpointSummary

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


def serve_grpc(store: CheckpointStore, writer: Writer, host: str = "127.0.0.1") -> tuple[grpc.Server, str]:
    """Start the gRPC server on a free port; returns (server, "host:port")."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_CheckpointerServicer_to_server(CheckpointerServicer(store, writer), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, f"{host}:{port}"
