"""Fault injection: whatever fails mid-save, the previous checkpoint stays the newest valid one and loads.

Specification: a writer killed with SIGKILL while a save is half staged leaves the previous checkpoint as the latest
valid one, and a restarted writer clears the debris and commits the step again; a full disk (ENOSPC) while writing a
shard or the manifest fails the save on every rank with the OS's reason and leaves no directory that looks
committed.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from services.checkpointer import store as store_module
from services.checkpointer.layout import STORE_ID
from services.checkpointer.load import find_latest_valid, load_checkpoint
from services.checkpointer.shard import Shard
from services.checkpointer.snapshot import SaveError, Snapshotter, new_session
from services.checkpointer.store import CheckpointStore
from services.checkpointer.writer import Writer
from services.common.registry import Registry

ROOT = Path(__file__).resolve().parent.parent
REDIS = "redis://127.0.0.1:6379"


def rows(full: torch.Tensor, rank: int) -> dict[str, Shard]:
    half = full.shape[0] // 2
    return {"w": Shard(full[rank * half:(rank + 1) * half], tuple(full.shape), (rank * half, 0))}


def full_state(step: int) -> torch.Tensor:
    return torch.full((64, 256), float(step))


def save_both(snaps: list[Snapshotter], step: int) -> None:
    for rank, snap in enumerate(snaps):
        snap.save(step, rows(full_state(step), rank), {"step": step})
    for snap in snaps:
        snap.wait(30)


def start_writer(ckpt: Path, run: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.checkpointer.writer", f"checkpoint.dir={ckpt}",
                             f"run.name={run}"], cwd=ROOT, env={**os.environ, "REDIS_URL": REDIS},
                            stderr=subprocess.PIPE, text=True)


def wait_until(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_sigkill_mid_save_keeps_the_previous_checkpoint_and_a_restart_recommits(tmp_path):
    run, ckpt = f"test-ckpt-{uuid.uuid4().hex[:8]}", tmp_path / "ckpt"
    registry = Registry(REDIS, run)
    writer = start_writer(ckpt, run)
    try:
        (record,) = registry.wait_for("checkpointer", timeout=30)
        snaps = [Snapshotter(record["zmq"], rank=r, world_size=2, session="a", timeout_s=2) for r in range(2)]
        save_both(snaps, 1)
        # Step 2: rank 0's half is staged, rank 1 has not sent yet — then the writer dies.
        snaps[0].save(2, rows(full_state(2), 0), {"step": 2})
        wait_until(lambda: (ckpt / "step_00000002.tmp" / "rank00000.json").exists())
        writer.send_signal(signal.SIGKILL)
        writer.wait(10)
        with pytest.raises(SaveError, match="no answer from the checkpoint writer"):
            snaps[0].wait(30)
        assert find_latest_valid(ckpt) == ckpt / "step_00000001"
        with load_checkpoint(ckpt / "step_00000001") as c:
            assert torch.equal(c.read("w"), full_state(1))
        for s in snaps:
            s.close()
        writer = start_writer(ckpt, run)
        wait_until(lambda: any(r["zmq"] != record["zmq"] for r in registry.lookup("checkpointer")))
        (fresh,) = [r for r in registry.lookup("checkpointer") if r["zmq"] != record["zmq"]]
        assert not (ckpt / "step_00000002.tmp").exists()  # the restarted writer cleared the debris
        snaps = [Snapshotter(fresh["zmq"], rank=r, world_size=2, session="b") for r in range(2)]
        save_both(snaps, 2)
        for s in snaps:
            s.close()
        with load_checkpoint(find_latest_valid(ckpt)) as c:
            assert c.step == 2 and torch.equal(c.read("w"), full_state(2))
    finally:
        if writer.poll() is None:
            writer.send_signal(signal.SIGTERM)
        writer.communicate(timeout=20)


@pytest.fixture
def in_process_writer(tmp_path):
    """A writer served from a thread, so a test can patch its disk writes."""
    registry = Registry(REDIS, f"test-ckpt-{uuid.uuid4().hex[:8]}")
    store = CheckpointStore(tmp_path, keep_last=3)
    writer = Writer(store, registry)
    stop = threading.Event()
    thread = threading.Thread(target=writer.serve, args=(stop,), daemon=True)
    thread.start()
    session = new_session()  # one per trainer incarnation, shared by its ranks
    snaps = [Snapshotter(writer.endpoint, rank=r, world_size=2, session=session, timeout_s=20) for r in range(2)]
    yield writer, snaps, tmp_path
    for s in snaps:
        s.close()
    stop.set()
    thread.join(10)


def enospc(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def assert_only_step_1(root: Path, within_s: float = 10.0) -> None:
    """Only step 1 is committed, and the failed save's staging directory is gone. The ranks hear of a failure at
    once, while a part another write thread is still writing finishes first: the writer removes the staging
    directory when that write ends (writer._fail), so it may outlive the answer by that write's time."""
    deadline = time.monotonic() + within_s
    while any(p.name.endswith(".tmp") for p in root.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(p.name for p in root.iterdir()) == [STORE_ID, "latest", "step_00000001"]
    assert find_latest_valid(root) == root / "step_00000001"
    assert (root / "latest").read_text().strip() == "step_00000001"


def test_disk_full_while_writing_a_shard_fails_the_save_and_leaves_no_half_checkpoint(in_process_writer,
                                                                                      monkeypatch):
    writer, snaps, root = in_process_writer
    save_both(snaps, 1)
    real = writer.store.write_part
    monkeypatch.setattr(writer.store, "write_part",
                        lambda step, rank, *a: enospc() if rank == 1 else real(step, rank, *a))
    for rank, snap in enumerate(snaps):
        snap.save(2, rows(full_state(2), rank))
    for snap in snaps:
        with pytest.raises(SaveError, match="rank 1 part 0: OSError.*No space left on device"):
            snap.wait(30)
    assert_only_step_1(root)
    assert writer.status().saves_failed == 1 and "No space left" in writer.status().last_error


def test_disk_full_while_writing_the_manifest_leaves_no_half_checkpoint(in_process_writer, monkeypatch):
    writer, snaps, root = in_process_writer
    save_both(snaps, 1)
    real = store_module.write_durable
    monkeypatch.setattr(store_module, "write_durable",
                        lambda path, data: enospc() if path.name == "manifest.json" else real(path, data))
    for rank, snap in enumerate(snaps):
        snap.save(2, rows(full_state(2), rank))
    for snap in snaps:
        with pytest.raises(SaveError, match="commit: OSError.*No space left on device"):
            snap.wait(30)
    assert_only_step_1(root)
    monkeypatch.setattr(store_module, "write_durable", real)
    save_both(snaps, 2)  # the disk has room again: the writer is still serving
    assert find_latest_valid(root) == root / "step_00000002"


def test_a_save_without_any_tensor_fails_and_commits_nothing(tmp_path):
    """A well-formed save that carries no tensor (a stray client's, or a fuzzer's: it happened) names the cause to the
    sender and never becomes a checkpoint, so it cannot shadow a real one as `latest`."""
    writer = Writer(CheckpointStore(tmp_path / "ckpt", keep_last=2), None)
    stop = threading.Event()
    thread = threading.Thread(target=writer.serve, args=(stop,), daemon=True)
    thread.start()
    saver = Snapshotter(writer.endpoint, timeout_s=30, share_memory=False, session=new_session())
    try:
        saver.save(7, {"w": torch.ones(3)})
        saver.wait(30)
        saver.save(9, {})
        with pytest.raises(SaveError, match="saved a tensor: nothing to commit"):
            saver.wait(30)
    finally:
        saver.close()
        stop.set()
        thread.join(10)
    store = CheckpointStore(tmp_path / "ckpt", keep_last=2)
    assert [s.step for s in store.list()] == [7] and store.latest_step() == 7
