"""The trainer side of a save (Snapshotter) against a hand-driven fake writer socket.

Specification: `save` returns once the tensors are copied (the caller may then overwrite them) and streams them in
parts; while a save is in flight a second one is skipped (`on_busy="skip"`) or waits (`on_busy="wait"`); the
writer's failure surfaces from `wait` (and from the next `save`), never silently; bad shards fail at `save`, naming
the tensor.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import zmq

from proto import checkpointer_pb2 as pb
from services.checkpointer.handoff import pick_writer
from services.checkpointer.load import load_checkpoint
from services.checkpointer.shard import Shard
from services.checkpointer.snapshot import SaveError, Snapshotter
from services.checkpointer.store import CheckpointStore
from services.common import wire
from services.common.registry import Registry


@pytest.fixture
def fake_writer():
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}"
    sock.close(linger=0)


def receive_save(sock: zmq.Socket) -> tuple[bytes, list[pb.ShardHeader], dict[str, torch.Tensor]]:
    """Every part of one rank's save: (identity, headers, tensors)."""
    headers, tensors = [], {}
    while True:
        assert sock.poll(10_000), "the snapshotter sent nothing"
        identity, *frames = sock.recv_multipart()
        kind, header, part = wire.decode(frames, pb.ShardHeader)
        assert kind == "ckpt.shard"
        headers.append(header)
        tensors.update(part)
        if header.part == header.num_parts - 1:
            return identity, headers, tensors


def answer(sock: zmq.Socket, identity: bytes, step: int, error: str = "") -> None:
    kind = "ckpt.failed" if error else "ckpt.committed"
    sock.send_multipart([identity, *wire.encode(kind, pb.SaveResult(step=step, path="" if error else f"/ck/{step}",
                                                                    error=error))])


def test_save_copies_then_streams_parts_with_boxes_and_extra(fake_writer):
    sock, endpoint = fake_writer
    snap = Snapshotter(endpoint, rank=1, world_size=2, session="s1", part_bytes=64)
    w = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    expected = w.clone()
    assert snap.save(7, {"w": Shard(w, (8, 8), (4, 0)), "step_t": torch.tensor(7)}, {"step": 7, "lr": 1e-3})
    w.zero_()  # the trainer moves on and overwrites its parameters: the snapshot must not change
    identity, headers, tensors = receive_save(sock)
    assert len(headers) == 2  # 128 bytes of `w` exceed part_bytes=64, so `step_t` travels in a second part
    assert [(h.step, h.rank, h.world_size, h.session, h.part, h.num_parts) for h in headers] == \
        [(7, 1, 2, "s1", 0, 2), (7, 1, 2, "s1", 1, 2)]
    assert json.loads(headers[0].extra) == {"step": 7, "lr": 1e-3} and headers[1].extra == b""
    rec = headers[0].tensors[0]
    assert (rec.name, list(rec.global_shape), list(rec.offsets)) == ("w", [8, 8], [4, 0])
    assert torch.equal(tensors["w"], expected) and tensors["step_t"].tolist() == [7]  # 0-d travels as [1]
    answer(sock, identity, 7)
    assert snap.wait(10) == "/ck/7"
    snap.close()


def test_replicated_shard_is_sent_only_by_its_writer_rank(fake_writer):
    sock, endpoint = fake_writer
    snap = Snapshotter(endpoint, rank=0, world_size=2)
    snap.save(1, {"mine": torch.ones(2), "shared": Shard(torch.ones(3), replicated=True, writer=False)})
    identity, _, tensors = receive_save(sock)
    assert sorted(tensors) == ["mine"]
    answer(sock, identity, 1)
    snap.wait(10)
    snap.close()


def test_on_busy_skip_returns_false_while_a_save_is_in_flight(fake_writer):
    sock, endpoint = fake_writer
    snap = Snapshotter(endpoint, on_busy="skip")
    assert snap.save(1, {"x": torch.zeros(3)})
    identity, _, _ = receive_save(sock)
    assert snap.save(2, {"x": torch.ones(3)}) is False  # step 1 not yet committed
    answer(sock, identity, 1)
    snap.wait(10)
    assert snap.save(3, {"x": torch.ones(3)})  # idle again: accepted
    identity, headers, _ = receive_save(sock)
    assert headers[0].step == 3
    answer(sock, identity, 3)
    snap.wait(10)
    snap.close()


def test_on_busy_wait_blocks_until_the_previous_save_is_committed(fake_writer):
    sock, endpoint = fake_writer
    snap = Snapshotter(endpoint, on_busy="wait")
    snap.save(1, {"x": torch.zeros(3)})
    identity, _, _ = receive_save(sock)
    returned = threading.Event()
    second = threading.Thread(target=lambda: (snap.save(2, {"x": torch.ones(3)}), returned.set()))
    second.start()
    time.sleep(0.3)
    assert not returned.is_set()  # still waiting for step 1's verdict
    answer(sock, identity, 1)
    assert returned.wait(10)
    second.join()
    identity, headers, _ = receive_save(sock)
    assert headers[0].step == 2
    answer(sock, identity, 2)
    snap.wait(10)
    snap.close()


def test_writer_failure_raises_from_wait_with_the_writers_reason(fake_writer):
    sock, endpoint = fake_writer
    snap = Snapshotter(endpoint)
    snap.save(4, {"x": torch.zeros(3)})
    identity, _, _ = receive_save(sock)
    answer(sock, identity, 4, error="save of step 4 failed: No space left on device")
    with pytest.raises(SaveError, match="No space left on device"):
        snap.wait(10)
    snap.wait(10)  # reported once
    snap.close()


def test_failure_not_yet_waited_for_is_raised_by_the_next_save(fake_writer):
    sock, endpoint = fake_writer
    snap = Snapshotter(endpoint)
    snap.save(4, {"x": torch.zeros(3)})
    identity, _, _ = receive_save(sock)
    answer(sock, identity, 4, error="disk on fire")
    with pytest.raises(SaveError, match="disk on fire"):
        snap.save(5, {"x": torch.zeros(3)})
    snap.close()


def test_no_answer_within_the_timeout_is_an_error_naming_the_writer(fake_writer):
    _, endpoint = fake_writer
    snap = Snapshotter(endpoint, timeout_s=0.5)
    snap.save(1, {"x": torch.zeros(3)})
    with pytest.raises(SaveError, match=f"no answer from the checkpoint writer at {endpoint}"):
        snap.wait(10)
    snap.close()


def test_bad_shards_and_extras_fail_at_save_naming_the_tensor():
    snap = Snapshotter("tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match=r"shard 'w': dimension 0 covers \[6, 10\)"):
        snap.save(1, {"w": Shard(torch.zeros(4, 2), (8, 2), (6, 0))})
    with pytest.raises(ValueError, match="JSON-serialisable"):
        snap.save(1, {}, {"rng": torch.get_rng_state()})
    with pytest.raises(ValueError, match="must be written"):
        snap.save(1, {"w": Shard(torch.zeros(2), writer=False)})
    snap.close()


def test_pick_writer_prefers_this_hosts_replicas_and_spreads_ranks_over_them():
    records = [{"instance": "a", "host": "h1", "zmq": "A"}, {"instance": "b", "host": "h2", "zmq": "B"},
               {"instance": "c", "host": "h2", "zmq": "C"}]
    assert [pick_writer(records, "h2", r)["zmq"] for r in range(4)] == ["B", "C", "B", "C"]
    assert pick_writer(records, "h1", 3)["zmq"] == "A"
    assert pick_writer(records, "elsewhere", 1)["zmq"] == "B"  # no local replica: any one, spread by rank


# ---------------------------------------------------------------- a real writer that dies and is replaced

ROOT = Path(__file__).resolve().parent.parent
REDIS = "redis://127.0.0.1:6379"


def start_writer(ckpt: Path, run: str, shm: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.checkpointer.writer", f"checkpoint.dir={ckpt}",
                             f"run.name={run}"], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "REDIS_URL": REDIS, "FOLDMOE_SHM_DIR": str(shm)})


def stop_writer(writer: subprocess.Popen) -> str:
    if writer.poll() is None:
        writer.send_signal(signal.SIGTERM)
    return writer.communicate(timeout=20)[1]


def wait_until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def halves(step: int, rank: int) -> dict[str, Shard]:
    full = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32) + step
    return {"w": Shard(full[32 * rank:32 * (rank + 1)], (64, 32), (32 * rank, 0)),
            "step": Shard(torch.tensor(step), replicated=True, writer=rank == 0)}


def assert_committed(ckpt: Path, steps: list[int]) -> None:
    saved = CheckpointStore(ckpt, keep_last=0).list(checksums=True)
    assert [s.step for s in saved] == steps
    assert all(s.valid for s in saved), [s.problem for s in saved if not s.valid]
    for step in steps:
        with load_checkpoint(ckpt / f"step_{step:08d}") as c:
            assert torch.equal(c.read("w"), torch.cat([halves(step, r)["w"].tensor for r in range(2)]))
            assert c.read("step").item() == step and [e["step"] for e in c.extras] == [step, step]


@pytest.fixture
def shm(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setenv("FOLDMOE_SHM_DIR", str(d))  # the snapshotters' arenas and the writers' probes
    return d


@contextlib.contextmanager
def two_ranks_and_a_writer(tmp_path: Path, shm, caplog):
    """A writer process and the Snapshotters of a two-rank job that find it through the registry. `run.writer` may be
    replaced inside the block; the one there at the end is stopped and its log left in `run.log`."""
    caplog.set_level(logging.WARNING, logger="foldmoe.checkpointer")
    name, ckpt = f"test-ckpt-{uuid.uuid4().hex[:8]}", tmp_path / "ckpt"
    run = SimpleNamespace(name=name, ckpt=ckpt, registry=Registry(REDIS, name), log="")
    run.writer = start_writer(ckpt, name, shm)
    try:
        (run.record,) = run.registry.wait_for("checkpointer", timeout=30)
        run.snaps = [Snapshotter(registry=run.registry, rank=r, world_size=2, session="s", timeout_s=60)
                     for r in range(2)]
        yield run
    finally:
        run.log = stop_writer(run.writer)


@pytest.mark.parametrize("record", ["removed", "expires"])
def test_a_save_in_flight_when_the_writer_is_killed_is_resent_to_its_replacement(tmp_path, shm, caplog, record):
    """The writer dies (SIGKILL) with rank 0's half of step 2 staged; rank 1 saves step 2 while no writer is registered
    (`removed`: the launcher deleted the dead record) or while the dead one's record lingers until its heartbeat TTL
    (`expires`). A replacement starts: both ranks send the whole step to it from their host buffers, and it commits."""
    with two_ranks_and_a_writer(tmp_path, shm, caplog) as run:
        ckpt, registry, snaps, dead = run.ckpt, run.registry, run.snaps, run.record
        for r, snap in enumerate(snaps):
            snap.save(1, halves(1, r), {"step": 1})
        assert [s.wait(30) for s in snaps] == [str(ckpt / "step_00000001")] * 2

        snaps[0].save(2, halves(2, 0), {"step": 2})
        wait_until(lambda: (ckpt / "step_00000002.tmp" / "rank00000.json").exists())  # in flight: staged, unanswered
        run.writer.send_signal(signal.SIGKILL)
        run.writer.wait(10)
        if record == "removed":  # as the launcher does when it restarts a crashed service
            registry.client.delete(registry._key("svc", "checkpointer", dead["instance"]))
            snaps[1].save(2, halves(2, 1), {"step": 2})  # sent while no writer is registered: it waits for one
            time.sleep(1.5)
        run.writer = start_writer(ckpt, run.name, shm)
        wait_until(lambda: any(r["pid"] != dead["pid"] for r in registry.lookup("checkpointer")))
        if record == "expires":
            snaps[1].save(2, halves(2, 1), {"step": 2})  # may go to the dead writer's lingering record first
        assert [s.wait(60) for s in snaps] == [str(ckpt / "step_00000002")] * 2
        for snap in snaps:
            snap.close()
        assert_committed(ckpt, [1, 2])
    assert "save of step 2 started" in run.log  # the replacement assembled step 2 from the re-sent parts
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("vanished from the registry before answering for step 2" in w and "waiting up to 60s" in w
               for w in warnings), warnings
    assert any("re-sending the whole checkpoint of step 2" in w for w in warnings), warnings


def test_a_live_writer_whose_record_lapses_is_not_sent_the_save_twice(tmp_path, shm, caplog):
    """The writer's registration disappears (e.g. Redis lost the key) while it holds rank 0's half of a save, and its
    heartbeat registers it again: the same process is not sent the parts again and commits the save once."""
    with two_ranks_and_a_writer(tmp_path, shm, caplog) as run:
        ckpt, registry, snaps, alive = run.ckpt, run.registry, run.snaps, run.record
        snaps[0].save(1, halves(1, 0), {"step": 1})
        wait_until(lambda: (ckpt / "step_00000001.tmp" / "rank00000.json").exists())
        registry.client.delete(registry._key("svc", "checkpointer", alive["instance"]))
        wait_until(lambda: any("vanished from the registry" in r.getMessage() for r in caplog.records))
        # Its heartbeat re-registers it; the snapshotter finds the same process and goes on waiting for its answer.
        wait_until(lambda: any("is registered again; still waiting for its answer for step 1" in r.getMessage()
                               for r in caplog.records))
        snaps[1].save(1, halves(1, 1), {"step": 1})
        assert [s.wait(30) for s in snaps] == [str(ckpt / "step_00000001")] * 2
        for snap in snaps:
            snap.close()
        assert_committed(ckpt, [1])
    assert run.log.count("save of step 1 started") == 1 and run.log.count("committed step 1") == 1, run.log
    assert not any("re-sending the whole checkpoint" in r.getMessage() for r in caplog.records)
