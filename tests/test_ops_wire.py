"""Every malformed or hostile message is a `WireError` from `wire.decode`, never another exception (a service loop
catches WireError, answers or drops the message and keeps serving): garbage, wrong versions, oversized headers, shapes
that do not match their frames, duplicated names; and well-formed messages still round-trip."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from proto import common_pb2
from services.common import wire
from services.common.wire import WireError


def header(*tensors: tuple[str, str, list[int]], version: int = wire.WIRE_VERSION, kind: str = "k") -> bytes:
    env = common_pb2.Envelope(version=version, kind=kind)
    for name, dtype, shape in tensors:
        env.tensors.add(name=name, dtype=dtype, shape=shape)
    return env.SerializeToString()


def test_well_formed_messages_round_trip():
    sent = {"a": torch.arange(6, dtype=torch.int64).reshape(2, 3), "b": torch.ones(0, 4), "c": torch.tensor([True])}
    kind, body, got = wire.decode(wire.encode("batch", common_pb2.TensorMeta(name="x"), sent), common_pb2.TensorMeta)
    assert kind == "batch" and body.name == "x"
    assert set(got) == set(sent) and all(torch.equal(got[k], sent[k]) for k in sent)


def test_decoded_tensors_are_the_receivers_own_copy_unless_asked_to_view_the_frames():
    """Over inproc a frame is the sender's tensor itself: by default the receiver gets a copy of its own; with
    copy=False a view of the frame, which the tensor keeps alive."""
    import gc

    import zmq

    sender, receiver = zmq.Context.instance().socket(zmq.PAIR), zmq.Context.instance().socket(zmq.PAIR)
    sender.bind("inproc://wire-copy")
    receiver.connect("inproc://wire-copy")
    try:
        sent = torch.zeros(1 << 18)  # 1 MiB: sent without a copy
        for _ in range(2):
            wire.send(sender, "k", tensors={"t": sent})
        _, _, own = wire.recv(receiver)
        _, _, view = wire.decode(receiver.recv_multipart(copy=False), copy=False)
        sent[0] = 7
        assert own["t"][0] == 0 and view["t"][0] == 7
        del sent
        gc.collect()
        assert view["t"][0] == 7 and view["t"].shape == (1 << 18,)
    finally:
        sender.close(linger=0)
        receiver.close(linger=0)


@pytest.mark.parametrize("frames, reason", [
    ([], "empty message"),
    ([b"\xff\xff\xff"], "not an Envelope"),
    ([header(version=99)], "wire version 99 is not supported"),
    ([header(("a", "int64", [2]))], "lists 1 tensors but 0 frames"),
    ([header(("a", "complex32", [1])), b"\0\0\0\0"], "unknown dtype"),
    ([header(("a", "int64", [-1])), b""], "negative dimension"),
    ([header(("a", "int64", [3])), b"\0" * 16], "needs 24 bytes, frame has 16"),
    ([header(("a", "uint8", [1 << 40, 1 << 40])), b"\0"], "bytes, frame has 1"),
    ([header(("a", "uint8", [1]), ("a", "uint8", [1])), b"\0", b"\0"], "appears twice"),
    ([b"\0" * (wire.MAX_HEADER_BYTES + 1)], "exceeds"),
])
def test_malformed_messages_are_wire_errors_naming_the_problem(frames, reason):
    with pytest.raises(WireError, match=reason):
        wire.decode(frames)


def test_a_body_of_the_wrong_type_is_a_wire_error():
    frames = [common_pb2.Envelope(version=wire.WIRE_VERSION, kind="k", body=b"\xff\xff").SerializeToString()]
    with pytest.raises(WireError, match="body of 'k' is not a TensorMeta"):
        wire.decode(frames, common_pb2.TensorMeta)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=4))
def test_random_bytes_never_raise_anything_but_wire_error(frames):
    try:
        wire.decode(frames, common_pb2.Envelope)
    except WireError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(["int64", "bool", "float16", "x"]),
                          st.lists(st.integers(-2, 1 << 62), max_size=3)), max_size=3),
       st.lists(st.binary(max_size=32), max_size=3))
def test_random_headers_over_random_frames_never_raise_anything_but_wire_error(tensors, payloads):
    try:
        wire.decode([header(*tensors), *payloads])
    except WireError:
        pass


def test_an_empty_tensor_whose_other_dimensions_overflow_is_a_wire_error():
    """Found by the fuzz test above: [2**32, 2**32, 0] needs 0 bytes, but torch cannot size its shape."""
    with pytest.raises(WireError, match="dimensions"):
        wire.decode([header(("a", "int64", [1 << 32, 1 << 32, 0])), b""])
