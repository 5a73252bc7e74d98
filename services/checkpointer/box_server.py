"""The checkpointer's load socket: any box of any tensor of a committed checkpoint, over ZMQ.

A trainer rank that does not see checkpoint.dir resumes through the checkpointer (services/checkpointer/remote.py):
gRPC `Open` names the checkpoint, and each box the rank's layout owns comes from here, one request ("ckpt.load", a
`LoadRequest`) and one answer ("ckpt.box": the box as a raw frame, sent from the box's own memory; or
"ckpt.load_failed"), both answers naming the request's `id`. The boxes are assembled from whichever saved pieces
overlap them, so any layout reads any layout's checkpoint. Bulk bytes take ZMQ as everywhere else in foldmoe (gRPC for
control, ZMQ for tensors).

A rank keeps a few requests in flight (remote.py's WINDOW), so this loop always finds the next request waiting: it
reads that box from the files while ZMQ's I/O thread is still sending the previous answer (`send_multipart` only queues
a frame that points into the box's memory). One thread serves the socket and answers in arrival order; the files of
the checkpoint being read stay open while its boxes are asked for.
"""

from __future__ import annotations

import threading

import torch
import zmq
from google.protobuf.message import DecodeError

from proto import checkpointer_pb2 as pb
from services.checkpointer.layout import CheckpointError, read_manifest
from services.checkpointer.load import Checkpoint, identity
from services.checkpointer.store import CheckpointStore
from services.common import logs, net, wire

log = logs.logger("checkpointer")

POLL_MS = 100  # how often the loop looks at its stop event


class BoxServer:
    def __init__(self, store: CheckpointStore, host: str = "127.0.0.1", advertise: str = "", token: str = ""):
        self.store, self.token = store, token
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{net.advertised(host, advertise)}:{port}"
        self._open: tuple[tuple, Checkpoint] | None = None  # the checkpoint being loaded, opened once for its boxes
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> BoxServer:
        self._thread = threading.Thread(target=self._serve, name="ckpt-boxes", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sock.close(linger=0)
        if self._open is not None:
            self._open[1].close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(POLL_MS):
                continue
            identity_frame, *frames = self.sock.recv_multipart(copy=False)
            self.sock.send_multipart([identity_frame, *self._answer(frames)], copy=False)

    def _answer(self, frames: list) -> list:
        try:
            _, request, _ = wire.decode(frames, pb.LoadRequest, token=self.token)
        except wire.Unauthenticated as e:
            return _failed("UNAUTHENTICATED", f"checkpointer refused the load: {e}", _id_of(e.body))
        except wire.WireError as e:
            return _failed("MALFORMED", f"not a load request: {e}", 0)
        try:
            box = self._read(request)
        except KeyError as e:
            return _failed("NOT_FOUND", str(e.args[0]), request.id)
        except ValueError as e:
            return _failed("INVALID_ARGUMENT", str(e), request.id)
        except CheckpointError as e:
            return _failed("DATA_LOSS", str(e), request.id)
        return wire.encode("ckpt.box", pb.LoadReply(id=request.id), {request.name: box})

    def _read(self, request: pb.LoadRequest) -> torch.Tensor:
        path = self.store.final_dir(request.step)
        try:
            key = identity(path)
        except CheckpointError as e:
            raise KeyError(str(e)) from None
        if self._open is None or self._open[0] != key:  # one at a time: a resume reads one checkpoint
            if self._open is not None:
                self._open[1].close()
            self._open = key, Checkpoint(path, read_manifest(path))
        return self._open[1].read(request.name, tuple(request.offsets) or None, tuple(request.shape) or None)


def _failed(code: str, message: str, id: int) -> list:
    return wire.encode("ckpt.load_failed", pb.LoadReply(code=code, message=message, id=id))


def _id_of(body: bytes) -> int:
    """The id of a refused request, so that its requester can tell which request was refused; 0 when unreadable."""
    request = pb.LoadRequest()
    try:
        request.ParseFromString(body)
    except (DecodeError, RuntimeWarning, ValueError):
        return 0
    return request.id
