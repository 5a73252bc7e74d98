"""The checkpointer's gRPC face: standard health plus the `Checkpointer` service (status, list, describe, delete, keep,
a save on request: save_requests.py), and `Open` for trainers that do not see the checkpoint directory: the newest
checkpoint that verifies, checked once for all ranks (the boxes themselves come over ZMQ: box_server.py)."""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING

import grpc

from proto import checkpointer_pb2 as pb
from proto import checkpointer_pb2_grpc as pb_grpc
from services.checkpointer.layout import MANIFEST, CheckpointError, parse_step
from services.checkpointer.load import newest_valid
from services.checkpointer.save_requests import SaveRequestError, ask
from services.checkpointer.store import CheckpointStore, CheckpointSummary
from services.common import grpc_server, net

if TYPE_CHECKING:
    from services.checkpointer.writer import Writer

SERVICE_NAME = "foldmoe.v1.Checkpointer"
SAVE_POLL_S = 0.2  # how often a waiting Save looks for its commit


def _info(s: CheckpointSummary) -> pb.CheckpointInfo:
    return pb.CheckpointInfo(step=s.step, path=str(s.path), keep=s.keep, latest=s.latest, bytes=s.bytes,
                             world_size=s.world_size, valid=s.valid, problem=s.problem)


class CheckpointerServicer(pb_grpc.CheckpointerServicer):
    def __init__(self, store: CheckpointStore, writer: Writer):
        self.store, self.writer = store, writer
        self._verified: set[tuple] = set()  # fingerprints of the checkpoints whose checksums Open checked
        self._verifying = threading.Lock()  # ranks resuming together: the first one verifies, the others find it done

    def _step(self, step: int, context: grpc.ServicerContext) -> int:
        if step >= 0:
            return step
        latest = self.store.latest_step()
        if latest < 0:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no checkpoint in {self.store.root} yet")
        return latest

    def Save(self, request, context):
        registry = self.writer.registry
        if registry is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this checkpointer runs without Redis: no trainer to ask")
        try:
            asked = ask(registry)
        except SaveRequestError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        reply = pb.SaveReply(step=asked.step, last=asked.last)
        if request.wait:
            reply.path = self._wait_for_commit(asked.step, context)
        return reply

    def _wait_for_commit(self, step: int, context: grpc.ServicerContext) -> str:
        """The committed directory of `step`, once it is there; aborts when the save fails or the trainer is gone."""
        final = self.store.final_dir(step)
        while context.is_active():
            if (final / MANIFEST).is_file():
                return str(final)
            if error := self.writer.error_of(step):
                context.abort(grpc.StatusCode.ABORTED, error)
            if not self.writer.registry.lookup("trainer") and not (final / MANIFEST).is_file():
                context.abort(grpc.StatusCode.ABORTED, f"the trainer stopped before saving step {step}")
            time.sleep(SAVE_POLL_S)
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"step {step} was not committed before the deadline; the "
                      "save still happens (SaveStatus shows it)")

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

    def Open(self, request, context):
        with self._verifying:
            path, problems = newest_valid(self.store.root, request.checksums, self._verified)
        if path is None and problems:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.store.root} holds {len(problems)} "
                          f"checkpoint(s) and none verifies ({'; '.join(problems)})")
        if path is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no committed checkpoint in {self.store.root}")
        return self.Describe(pb.DescribeRequest(step=parse_step(path.name)), context)

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
