"""Weight sync: what a worker receives is exactly the published state in the sync dtype, whatever the chunking, and the
staleness bound holds (a worker too far behind waits)."""

from __future__ import annotations

import threading
import time

import pytest
import zmq
import torch

from services.rl_rollout.weights import PolicyWeights, SyncStopped, VersionGone, WeightReceiver, WeightSyncError
from services.trainer.rl.weight_publisher import WeightPublisher, chunk_state
from tests.rl_helpers import tiny_model


@pytest.fixture
def publisher():
    pub = WeightPublisher(chunk_bytes=4096).start()
    yield pub
    pub.stop()


def test_chunks_cover_every_tensor_exactly_once_and_respect_the_size():
    state = {"a": torch.arange(10, dtype=torch.float32), "big": torch.ones(3, 1000), "empty": torch.zeros(0),
             "ids": torch.arange(5)}
    chunks = chunk_state(state, 1000)
    seen: dict[str, int] = {}
    for pieces, tensors in chunks:
        assert sum(t.numel() * t.element_size() for t in tensors) <= 1000 + 8
        for p, t in zip(pieces, tensors):
            assert p.offset == seen.get(p.name, 0) and t.numel() == p.numel
            seen[p.name] = p.offset + p.numel
    assert seen == {k: v.numel() for k, v in state.items()}


def test_worker_receives_the_published_state_in_bf16_with_integer_buffers_intact(publisher):
    trainer = tiny_model(seed=1)
    with torch.no_grad():
        trainer.moe_layers()[0].router.expert_bias.copy_(torch.tensor([0.5, -0.25, 0.0, 1.0]))
    publisher.publish(0, trainer.state_dict())
    receiver = WeightReceiver(publisher.endpoint, timeout_s=5)
    manifest = receiver.latest()
    assert manifest.version == 0 and manifest.num_chunks > 10  # a 4 KB chunk size forces tensors to be split
    got = receiver.fetch(manifest)
    expected = trainer.state_dict()
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        assert got[name].dtype == (torch.bfloat16 if t.is_floating_point() else t.dtype), name
        assert torch.equal(got[name], t.to(got[name].dtype)), name
    receiver.close()


def test_policy_weights_wait_for_the_first_version_then_follow_the_newest(publisher):
    worker = tiny_model(seed=2)
    policy = PolicyWeights(worker, WeightReceiver(publisher.endpoint, timeout_s=5), max_staleness=1, poll_s=0.02)
    assert policy.refresh(timeout_s=0.2) is False and policy.version == -1  # nothing published: no weights to use
    trainer = tiny_model(seed=7)
    publisher.publish(0, trainer.state_dict())
    assert policy.refresh(timeout_s=5) and policy.version == 0
    with torch.no_grad():
        trainer.output.weight.add_(1.0)
    publisher.publish(1, trainer.state_dict())
    publisher.publish(2, trainer.state_dict())
    assert policy.refresh(timeout_s=5) and policy.version == 2
    assert torch.equal(worker.output.weight, trainer.output.weight.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="not newer"):
        publisher.publish(2, trainer.state_dict())


class _BlockedReceiver(WeightReceiver):
    """Sees the newest version but cannot pull it while `blocked` (e.g. a network partition to the publisher)."""

    blocked = False

    def fetch(self, manifest):
        if self.blocked:
            raise WeightSyncError("injected: publisher unreachable")
        return super().fetch(manifest)


def test_a_worker_too_far_behind_waits_until_it_gets_newer_weights(publisher):
    state = tiny_model(seed=3).state_dict()
    receiver = _BlockedReceiver(publisher.endpoint, timeout_s=5)
    policy = PolicyWeights(tiny_model(seed=4), receiver, max_staleness=1, poll_s=0.02)
    publisher.publish(0, state)
    assert policy.refresh(timeout_s=5) and policy.version == 0
    receiver.blocked = True
    publisher.publish(1, state)
    assert policy.refresh(timeout_s=5) and policy.version == 0  # one behind: within the bound, keep generating
    publisher.publish(2, state)
    assert policy.refresh(timeout_s=0.3) is False and policy.behind() == 2  # two behind: must not generate
    receiver.blocked = False
    assert policy.refresh(timeout_s=5) and policy.version == 2 and policy.behind() == 0


def test_a_version_superseded_mid_pull_is_reported_and_the_newest_is_loaded_instead():
    pub = WeightPublisher(chunk_bytes=4096, keep=1).start()
    try:
        state = tiny_model(seed=5).state_dict()
        pub.publish(0, state)
        receiver = WeightReceiver(pub.endpoint, timeout_s=5)
        stale = receiver.latest()
        pub.publish(1, state)
        with pytest.raises(VersionGone):
            receiver.fetch(stale)
        policy = PolicyWeights(tiny_model(seed=6), receiver, max_staleness=0)
        assert policy.refresh(timeout_s=5) and policy.version == 1
    finally:
        pub.stop()


def test_an_unreachable_publisher_is_named_in_the_error():
    receiver = WeightReceiver("tcp://127.0.0.1:9", timeout_s=0.2)
    with pytest.raises(WeightSyncError, match="did not answer"):
        receiver.latest()
    receiver.close()


def test_a_worker_follows_a_restarted_trainer_even_to_a_lower_version():
    """A trainer restarted from its step-1 checkpoint publishes version 1 on a new endpoint; a worker that had version 3
    of the abandoned timeline must load the new version 1, not keep its 'newer' weights."""
    old, new = WeightPublisher(chunk_bytes=4096).start(), WeightPublisher(chunk_bytes=4096).start()
    try:
        where = {"endpoint": old.endpoint}
        abandoned, restored = tiny_model(seed=8), tiny_model(seed=9)
        old.publish(3, abandoned.state_dict())
        worker = tiny_model(seed=10)
        policy = PolicyWeights(worker, None, max_staleness=1, poll_s=0.02, locate=lambda: where["endpoint"],
                               timeout_s=5)
        assert policy.refresh(timeout_s=5) and policy.version == 3
        new.publish(1, restored.state_dict())
        where["endpoint"] = new.endpoint
        assert policy.refresh(timeout_s=5) and policy.version == 1
        assert torch.equal(worker.output.weight, restored.output.weight.to(torch.bfloat16).float())
        policy.close()
    finally:
        old.stop()
        new.stop()


def test_a_stopping_worker_abandons_a_wait_on_a_silent_publisher_at_once():
    stop = threading.Event()
    receiver = WeightReceiver("tcp://127.0.0.1:9", timeout_s=30, stop=stop)
    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(SyncStopped):
        receiver.latest()
    assert time.monotonic() - t0 < 2  # not the 30 s timeout
    receiver.close()


def test_a_dropped_versions_buffers_are_reused_only_once_zmq_has_let_go_of_its_frames():
    """Versions live in host buffers that later versions reuse (page-locking them is as slow as the copy); a buffer
    whose frames ZMQ may still be sending to a slow worker must not be overwritten."""
    pub = WeightPublisher(chunk_bytes=4096, keep=1).start()
    try:
        pub.publish(1, {"w": torch.full((64,), 1.0)})
        first = pub._versions[1]
        in_flight = threading.Event()  # a send ZMQ has not finished with
        first.sends.append(zmq.MessageTracker(in_flight))
        pub.publish(2, {"w": torch.full((64,), 2.0)})  # version 1 dropped, its frames still held
        pub.publish(3, {"w": torch.full((64,), 3.0)})
        assert pub._versions[3].arena is not first.arena
        assert torch.equal(first.arena.views["w"], torch.full((64,), 1.0, dtype=torch.bfloat16))
        in_flight.set()
        second = pub._retired[-1].arena  # version 2's, dropped by version 3, never sent
        pub.publish(4, {"w": torch.full((64,), 4.0)})
        assert pub._versions[4].arena in (first.arena, second)  # reused, not a new buffer
        receiver = WeightReceiver(pub.endpoint, timeout_s=5)
        got = receiver.fetch(receiver.latest())
        assert torch.equal(got["w"], torch.full((64,), 4.0, dtype=torch.bfloat16))
        receiver.close()
    finally:
        pub.stop()


def test_served_chunks_are_tracked_until_sent_and_then_free_their_buffers(publisher):
    publisher.publish(0, {"w": torch.arange(4096.0)})
    receiver = WeightReceiver(publisher.endpoint, timeout_s=5)
    got = receiver.fetch(receiver.latest())
    assert torch.equal(got["w"], torch.arange(4096.0).to(torch.bfloat16))
    held = publisher._versions[0]
    assert held.sends, "chunk sends are not tracked"
    deadline = time.monotonic() + 5
    while not held.sent() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held.sent()
    receiver.close()


def test_an_error_while_filling_a_version_publishes_nothing(publisher):
    publisher.publish(0, {"w": torch.zeros(8)})
    with pytest.raises(RuntimeError, match="gather failed"):
        with publisher.new_version(1, {"w": publisher.spec(torch.zeros(8))}) as host:
            host["w"].fill_(7)
            raise RuntimeError("gather failed")
    assert publisher.latest == 0
    with pytest.raises(ValueError, match="not newer"):
        publisher.publish(0, {"w": torch.zeros(8)})
