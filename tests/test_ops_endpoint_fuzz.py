"""Hostile traffic at the live ZMQ endpoints (issue #9): garbage frames, truncated frames, wrong wire versions, unknown
kinds, oversized headers, and well-formed envelopes of the right kind whose protobuf bodies carry arbitrary field
values (ranks past the world, zero parts, huge steps, paths that are not snapshots). Each service must answer or drop
every such message and keep serving: after the fuzzing, a real client still gets correct answers, and the serving
thread is still alive. hypothesis generates the messages; `wire.decode` alone is covered by tests/test_ops_wire.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto import checkpointer_pb2, common_pb2, dataloader_pb2, rollout_pb2
from services.checkpointer.snapshot import Snapshotter
from services.checkpointer.store import CheckpointStore
from services.checkpointer.writer import Writer
from services.common import wire
from services.dataloader.client import DataClient
from services.dataloader.server import DataLoaderServer
from services.rl_rollout.weights import WeightReceiver
from services.trainer.rl.weight_publisher import WeightPublisher
from tests.test_dataloader_service import make_cfg

EXAMPLES = 120
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

_INTS = {FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1), FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
         FieldDescriptor.TYPE_INT32: (-2**31, 2**31 - 1), FieldDescriptor.TYPE_INT64: (-2**63, 2**63 - 1)}


def interesting_int(lo: int, hi: int):
    """Edge values (0, 1, the bounds) as often as arbitrary ones."""
    return st.one_of(st.sampled_from([v for v in (0, 1, 2, lo, hi, -1) if lo <= v <= hi]), st.integers(lo, hi))


def field_value(draw, field, depth: int):
    if field.type in _INTS:
        return draw(interesting_int(*_INTS[field.type]))
    if field.type == FieldDescriptor.TYPE_BOOL:
        return draw(st.booleans())
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return draw(st.floats(allow_nan=True, width=32))
    if field.type == FieldDescriptor.TYPE_STRING:
        return draw(st.one_of(st.text(max_size=24), st.sampled_from(["/dev/zero", "/etc/hostname", "../../x", "{"])))
    if field.type == FieldDescriptor.TYPE_BYTES:
        return draw(st.one_of(st.binary(max_size=32), st.sampled_from([b"{}", b"[1]", b'{"step": "x"}'])))
    if field.type == FieldDescriptor.TYPE_MESSAGE and depth < 2:
        return draw(message(field.message_type._concrete_class, depth + 1))
    return None


def repeated(field) -> bool:
    # protobuf 6+ has `is_repeated` (and dropped `label` in the upb backend); older ones only `label`.
    return field.is_repeated if hasattr(field, "is_repeated") else field.label == FieldDescriptor.LABEL_REPEATED


@st.composite
def message(draw, cls, depth: int = 0):
    """An instance of protobuf class `cls` with arbitrary values in a random subset of its fields."""
    msg = cls()
    for field in cls.DESCRIPTOR.fields:
        if not draw(st.booleans()):
            continue
        if repeated(field):
            values = [field_value(draw, field, depth) for _ in range(draw(st.integers(0, 3)))]
            values = [v for v in values if v is not None]
            getattr(msg, field.name).extend(values)
        else:
            value = field_value(draw, field, depth)
            if value is None:
                continue
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                getattr(msg, field.name).CopyFrom(value)
            else:
                setattr(msg, field.name, value)
    return msg


@st.composite
def hostile(draw, kinds: dict[str, type], token: str = ""):
    """Frames of one hostile message for a service whose request kinds are `kinds` (kind -> body class)."""
    shape = draw(st.sampled_from(["garbage", "envelope"]))
    if shape == "garbage":
        return draw(st.lists(st.binary(max_size=48), max_size=4))
    kind = draw(st.one_of(st.sampled_from(sorted(kinds)), st.text(max_size=12)))
    body_cls = kinds.get(kind) or draw(st.sampled_from(sorted(kinds.values(), key=lambda c: c.__name__)))
    body = draw(message(body_cls))
    env = common_pb2.Envelope(version=draw(st.sampled_from([wire.WIRE_VERSION, wire.WIRE_VERSION, 0, 7])), kind=kind,
                              body=draw(st.one_of(st.just(body.SerializeToString()), st.binary(max_size=24))),
                              token=token)
    frames = [env.SerializeToString()]
    for i in range(draw(st.integers(0, 2))):
        dtype = draw(st.sampled_from(["float32", "int64", "uint8", "bogus"]))
        dims = draw(st.lists(st.integers(-1, 5), max_size=3))
        env.tensors.add(name=draw(st.sampled_from(["w", "x", f"t{i}"])), dtype=dtype, shape=dims)
        frames.append(draw(st.binary(max_size=64)))
    frames[0] = env.SerializeToString()
    if draw(st.booleans()) and len(frames) > 1:
        frames = frames[:-1]  # truncated: a tensor frame missing
    return frames


def blast(endpoint: str, frames: list, delimiter: bool = False) -> None:
    """Send one message from a fresh DEALER (a new identity each time, as a stranger would) and drain any answer."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b""] + frames if delimiter else (frames or [b""]))
        if sock.poll(20):
            sock.recv_multipart()
    finally:
        sock.close()


def oversized_header() -> list:
    return [b"\x0a" + b"\xff" * (wire.MAX_HEADER_BYTES + 16)]


def test_dataloader_keeps_serving_through_hostile_messages(tmp_path):
    server = DataLoaderServer(make_cfg(tmp_path)).start()
    try:
        kinds = {"hello": dataloader_pb2.DataHello, "credit": dataloader_pb2.DataCredit}

        @FUZZ
        @given(hostile(kinds))
        def fuzz(frames):
            blast(server.zmq_endpoint, frames)
            assert server.error is None, f"serving loop died on {frames!r}: {server.error!r}"

        fuzz()
        blast(server.zmq_endpoint, oversized_header())
        assert server.error is None
        c = DataClient(server.zmq_endpoint, server.grpc_endpoint, dp_rank=0, dp_size=1, grad_accum=2, timeout=10)
        step = c.next_step()
        assert len(step) == 2 and all(mb["tokens"].numel() == 2 * 64 for mb in step)
        c.close()
    finally:
        server.stop()


def test_checkpointer_keeps_serving_through_hostile_messages(tmp_path):
    writer = Writer(CheckpointStore(tmp_path / "ckpt", keep_last=2), None)
    stop = threading.Event()
    thread = threading.Thread(target=writer.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        kinds = {"ckpt.shard": checkpointer_pb2.ShardHeader}

        @FUZZ
        @given(hostile(kinds))
        def fuzz(frames):
            blast(writer.endpoint, frames)
            assert thread.is_alive(), f"writer loop died on {frames!r}"

        fuzz()
        blast(writer.endpoint, oversized_header())
        assert thread.is_alive()
        state = {"w": torch.arange(12.0).reshape(3, 4)}
        saver = Snapshotter(writer.endpoint, timeout_s=30, share_memory=False, session="fuzz-check")
        try:
            saver.save(5, state)
            path = saver.wait(30)
        finally:
            saver.close()
        assert path.endswith("step_00000005")
        store = CheckpointStore(tmp_path / "ckpt", keep_last=2)
        assert store.latest_step() == 5
        assert [s.step for s in store.list()] == [5]  # nothing the fuzzing sent was committed as a checkpoint
    finally:
        stop.set()
        thread.join(10)


def test_weight_publisher_keeps_serving_through_hostile_messages():
    publisher = WeightPublisher(chunk_bytes=4096).start()
    try:
        publisher.publish(4, {"w": torch.arange(8.0)})
        kinds = {"weights_latest": rollout_pb2.WeightsRequest, "weights_chunk": rollout_pb2.WeightsRequest}

        @FUZZ
        @given(hostile(kinds), st.booleans())
        def fuzz(frames, delimiter):
            blast(publisher.endpoint, frames, delimiter)
            assert publisher._thread.is_alive(), f"publisher loop died on {frames!r}"

        fuzz()
        blast(publisher.endpoint, oversized_header(), delimiter=True)
        time.sleep(0.1)
        receiver = WeightReceiver(publisher.endpoint, timeout_s=10)
        manifest = receiver.latest()
        assert manifest.version == 4
        assert torch.equal(receiver.fetch(manifest)["w"].float(), torch.arange(8.0))
        receiver.close()
    finally:
        publisher.stop()


@pytest.mark.parametrize("bad", ["garbage", "wrong_version"])
def test_a_hostile_message_gets_an_error_answer_not_silence_where_the_protocol_has_one(tmp_path, bad):
    # The dataloader and the weight publisher answer every request; a refusal must say what was wrong.
    frames = [b"\xff\xfe"] if bad == "garbage" else [common_pb2.Envelope(version=99, kind="hello").SerializeToString()]
    server = DataLoaderServer(make_cfg(tmp_path)).start()
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(server.zmq_endpoint)
        sock.send_multipart(frames)
        assert sock.poll(5000), "no answer to a malformed message"
        kind, reply, _ = wire.decode(sock.recv_multipart(), dataloader_pb2.DataErrorReply)
        assert kind == "error" and "malformed message" in reply.message
    finally:
        sock.close()
        server.stop()
