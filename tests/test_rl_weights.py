"""Weight sync: what a worker receives is exactly the published state in the sync dtype, whatever the chunking and
whether it reads the publisher's shared-memory file (same host) or pulls chunks over ZMQ, and the staleness bound holds
(a worker too far behind waits)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import zmq
import torch

from services.common.host_memory import shm_dir
from services.rl_rollout.weights import PolicyWeights, SyncStopped, VersionGone, WeightReceiver, WeightSyncError
from services.trainer.rl.weight_publisher import WeightPublisher, chunk_state
from tests.rl_helpers import tiny_model


@pytest.fixture(params=["shared", "chunks"], autouse=True)
def transport(request, monkeypatch, tmp_path):
    """"shared": the publisher's buffers are files in a shared-memory directory workers can open (this host's
    /dev/shm, or a temporary one); "chunks": there is none, so every byte travels in chunks over ZMQ."""
    if request.param == "chunks":
        monkeypatch.setenv("FOLDMOE_SHM_DIR", str(tmp_path / "no-such-dir"))
    elif not shm_dir().is_dir():
        (tmp_path / "shm").mkdir()
        monkeypatch.setenv("FOLDMOE_SHM_DIR", str(tmp_path / "shm"))
    return request.param


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


def test_worker_receives_the_published_state_in_bf16_with_integer_buffers_intact(publisher, transport):
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
    receiver.confirm(manifest)
    assert receiver.shared_reads == (transport == "shared")
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
            receiver.fetch(stale)  # in chunks: the first chunk's request finds the version gone
            receiver.confirm(stale)  # from shared memory: read whole only if the version is still kept after
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


@pytest.mark.parametrize("transport", ["chunks"], indirect=True)
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


@pytest.mark.parametrize("transport", ["shared"], indirect=True)
def test_a_shared_read_overtaken_by_buffer_reuse_is_not_taken_for_the_version_it_started_as():
    """A worker reads a version from the publisher's shared file while the trainer publishes two more, the second into
    the same (reused) buffers: what it loaded is not that version. It must pull again, not keep generating with it."""
    pub = WeightPublisher(chunk_bytes=4096, keep=1).start()
    states = [tiny_model(seed=s).state_dict() for s in (11, 12, 13)]

    class Overtaken(WeightReceiver):
        def fetch(self, manifest):
            views = super().fetch(manifest)
            if manifest.version == 0:
                pub.publish(1, states[1])
                pub.publish(2, states[2])  # into version 0's buffers, which no send holds
            return views

    try:
        pub.publish(0, states[0])
        receiver = Overtaken(pub.endpoint, timeout_s=5)
        worker = tiny_model(seed=14)
        policy = PolicyWeights(worker, receiver, max_staleness=5)
        assert policy.refresh(timeout_s=5)
        assert receiver.shared_reads == 2 and policy.version == 2
        assert torch.equal(worker.output.weight, states[2]["output.weight"].to(torch.bfloat16).float())
        policy.close()
    finally:
        pub.stop()


@pytest.mark.parametrize("transport", ["shared"], indirect=True)
def test_the_publishers_shared_files_are_gone_once_it_stops():
    pub = WeightPublisher(chunk_bytes=4096, keep=1).start()
    for version in range(3):  # in two files: the kept version's and the dropped one's, reused
        pub.publish(version, {"w": torch.full((64,), float(version))})
    mine = f"pid{os.getpid()}-weights-"
    assert len([p for p in shm_dir().iterdir() if mine in p.name]) == 2
    pub.stop()
    assert not [p for p in shm_dir().iterdir() if mine in p.name]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="registering host memory needs a CUDA device")
@pytest.mark.parametrize("transport", ["shared"], indirect=True)
def test_cuda_a_worker_with_a_cuda_model_registers_each_shared_file_once_and_loads_exactly_the_published():
    """Read-only registration makes the copies into the model DMA from the file; it must change no byte, and each file
    the publisher cycles through is registered on its first read only (a registration locks every page: seconds)."""
    pub = WeightPublisher(chunk_bytes=4096, keep=1).start()
    worker = tiny_model(seed=21).cuda()
    policy = PolicyWeights(worker, None, max_staleness=0, locate=lambda: pub.endpoint)
    try:
        registered = set()
        for version in range(4):  # two files: the kept version's and the dropped one's, reused
            trainer = tiny_model(seed=30 + version)
            pub.publish(version, trainer.state_dict())
            assert policy.refresh(timeout_s=10) and policy.version == version
            for name, t in trainer.state_dict().items():
                want = t.to(torch.bfloat16) if t.is_floating_point() else t
                assert torch.equal(worker.state_dict()[name].cpu().to(want.dtype), want), name
            maps = policy.receiver._maps
            assert all(m._registered for m in maps.values())
            registered |= {m._registered for m in maps.values()}
        assert policy.receiver.pin and policy.receiver.shared_reads == 4 and len(registered) == 2
    finally:
        policy.close()
        pub.stop()


def test_prepared_buffers_serve_the_first_versions_so_no_publish_allocates(monkeypatch):
    """`prepare` page-locks the first keep + 1 versions' buffers in its own thread; the publishes take them (the first
    waits for them) and, once versions are dropped, reuse them: no publish allocates. A version of other shapes
    allocates its own rather than waiting for ever."""
    made: list[str] = []
    new_arena = WeightPublisher._new_arena
    monkeypatch.setattr(WeightPublisher, "_new_arena",
                        staticmethod(lambda specs: made.append(threading.current_thread().name) or new_arena(specs)))
    pub = WeightPublisher(chunk_bytes=4096, keep=2).start()
    try:
        state = tiny_model(seed=40).state_dict()
        pub.prepare({k: pub.spec(v) for k, v in state.items()})
        for version in range(6):
            pub.publish(version, state)
        assert made == ["weights-prepare"] * 3
        pub.publish(6, {"other": torch.ones(3)})
        assert made[3:] == ["MainThread"]
        receiver = WeightReceiver(pub.endpoint, timeout_s=5)
        assert torch.equal(receiver.fetch(receiver.latest())["other"], torch.ones(3, dtype=torch.bfloat16))
        receiver.close()
    finally:
        pub.stop()
