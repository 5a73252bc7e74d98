"""ZMQ tensor framing: one `Envelope` header frame, then one raw frame per tensor. No pickling anywhere.

Receivers validate the header (size, version, tensor names, dtype names, byte counts) before touching the payload, so
a malformed or hostile message raises `WireError` (and nothing else) instead of producing garbage tensors; every
service's receive loop answers or drops on `WireError` and keeps serving.

Authentication (services/common/net.py): a sender puts the run's token in the header (`encode(..., token=)`); a
receiver that requires one passes it to `decode(..., token=)`, which checks it before reading any payload and raises
`Unauthenticated` (a `WireError`) when it is missing or wrong.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import zmq
from google.protobuf.message import DecodeError, Message

from proto import common_pb2
from services.common import net

WIRE_VERSION = 1
MAX_FRAME_BYTES = 8 << 30
MAX_HEADER_BYTES = 64 << 20  # an Envelope is names, shapes and a small body; more is not a foldmoe message

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}

M = TypeVar("M", bound=Message)


class WireError(ValueError):
    """A received message that does not follow the framing contract."""


class Unauthenticated(WireError):
    """A request without the receiver's auth token. `kind` and `body` (raw bytes) let the receiver address its refusal."""

    def __init__(self, message: str, kind: str, body: bytes):
        super().__init__(message)
        self.kind, self.body = kind, body


def encode(kind: str, body: Message | None, tensors: dict[str, torch.Tensor] | None = None, token: str = "") -> list:
    """Frames for `socket.send_multipart`; tensors are sent as zero-copy buffers of their CPU contiguous storage."""
    env = common_pb2.Envelope(version=WIRE_VERSION, kind=kind, body=body.SerializeToString() if body is not None else b"",
                              token=token)
    frames: list = []
    for name, t in (tensors or {}).items():
        t = t.detach().to("cpu").contiguous()
        env.tensors.add(name=name, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape))
        frames.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b"")
    return [env.SerializeToString(), *frames]


def decode(frames: list, body_type: type[M] | None = None, token: str = "",
           copy: bool = True) -> tuple[str, M | None, dict[str, torch.Tensor]]:
    """Inverse of `encode`: returns (kind, body, tensors). `token`: the one the sender must have put in the header.
    `copy=False`: the tensors view the frames' memory (each keeps its frame alive) instead of a writable copy, for a
    receiver that only copies them on; they are not to be written or kept, as over inproc a frame is the sender's
    tensor itself."""
    if not frames:
        raise WireError("empty message")
    header = frames[0].buffer if isinstance(frames[0], zmq.Frame) else frames[0]
    if len(header) > MAX_HEADER_BYTES:
        raise WireError(f"header frame of {len(header)} bytes exceeds {MAX_HEADER_BYTES}; not a foldmoe message")
    env = common_pb2.Envelope()
    try:
        env.ParseFromString(bytes(header))
    except (DecodeError, RuntimeWarning, ValueError) as e:
        raise WireError(f"header frame is not an Envelope: {e}") from None
    if env.version != WIRE_VERSION:
        raise WireError(f"wire version {env.version} is not supported (expected {WIRE_VERSION})")
    if not net.token_ok(env.token, token):
        raise Unauthenticated(net.refusal(env.token), env.kind, env.body)
    if len(env.tensors) != len(frames) - 1:
        raise WireError(f"header lists {len(env.tensors)} tensors but {len(frames) - 1} frames arrived")
    tensors: dict[str, torch.Tensor] = {}
    for meta, frame in zip(env.tensors, frames[1:]):
        if meta.name in tensors:
            raise WireError(f"tensor {meta.name!r} appears twice in the header")
        dtype = _DTYPES.get(meta.dtype)
        if dtype is None:
            raise WireError(f"tensor {meta.name!r} has unknown dtype {meta.dtype!r}")
        buf = frame.buffer if isinstance(frame, zmq.Frame) else frame
        nbytes, spans = dtype.itemsize, dtype.itemsize  # spans: the bytes without zero dimensions
        for s in meta.shape:
            if s < 0:
                raise WireError(f"tensor {meta.name!r} has a negative dimension {list(meta.shape)}")
            nbytes = min(nbytes * s, MAX_FRAME_BYTES + 1)  # bounded: a hostile shape must not build a huge integer
            spans = min(spans * max(s, 1), MAX_FRAME_BYTES + 1)
        if nbytes == 0 and spans > MAX_FRAME_BYTES:  # empty, but torch cannot size e.g. [2**32, 2**32, 0]
            raise WireError(f"tensor {meta.name!r} has dimensions {list(meta.shape)} beyond {MAX_FRAME_BYTES} bytes")
        if nbytes > MAX_FRAME_BYTES or len(buf) != nbytes:
            raise WireError(f"tensor {meta.name!r} {list(meta.shape)} {meta.dtype} needs {nbytes} bytes, frame has {len(buf)}")
        # One copy into memory of the receiver's own: a frame may be the sender's memory (inproc) and receivers may
        # modify batches in place.
        if not nbytes:
            flat = torch.empty(0, dtype=torch.uint8)
        else:
            flat = torch.frombuffer(bytearray(buf) if copy else buf, dtype=torch.uint8)
        tensors[meta.name] = flat.view(dtype).reshape(tuple(meta.shape))
    body = None
    if body_type is not None:
        body = body_type()
        try:
            body.ParseFromString(env.body)
        except (DecodeError, RuntimeWarning, ValueError) as e:
            raise WireError(f"body of {env.kind!r} is not a {body_type.__name__}: {e}") from None
    return env.kind, body, tensors


def send(sock: zmq.Socket, kind: str, body: Message | None = None, tensors: dict[str, torch.Tensor] | None = None,
         flags: int = 0, token: str = "") -> None:
    sock.send_multipart(encode(kind, body, tensors, token), flags=flags, copy=False)


def recv(sock: zmq.Socket, body_type: type[M] | None = None, flags: int = 0):
    """Receive one framed message; returns (kind, body, tensors)."""
    return decode(sock.recv_multipart(flags=flags, copy=False), body_type)
