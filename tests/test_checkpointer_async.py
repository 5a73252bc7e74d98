"""Trainer-side snapshot buffers and the shared-memory handoff (issue #5: the stall is the copy, nothing else).

Specification: host buffers are allocated once by `prepare` and reused by every save of the same shapes (a changed
state re-allocates and is counted); they live in a shared-memory file that a writer proving it sees the same /dev/shm
reads in place, while any other writer gets ZMQ frames, with identical checkpoints either way; `host_buffers=2` lets a
second save start while the first is being written; files left by dead trainers are removed; the writer writes a
save's parts on several threads at once. On CUDA, a save returns before its copies finish and the optimizer step after
it still cannot change what was saved.
"""

from __future__ import annotations

import os
import subprocess
import sys
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
import zmq

from proto import checkpointer_pb2 as pb
from services.checkpointer.load import load_checkpoint
from services.checkpointer.shard import Shard
from services.checkpointer.shm import make_shm_probe
from services.checkpointer.snapshot import Snapshotter
from services.checkpointer.store import CheckpointStore
from services.checkpointer.writer import Writer
from services.common import wire
from services.common.host_memory import SHM_PREFIX, HostArena, TensorSpec, remove_stale_files
from services.common.registry import Registry

ROOT = Path(__file__).resolve().parent.parent
REDIS = "redis://127.0.0.1:6379"


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """A private shared-memory directory for this test (the arena and the writer probe both honour it). On tmpfs, like
    /dev/shm itself: CUDA can page-lock (cudaHostRegister) a shared mapping of a tmpfs file, not of a disk file."""
    base = Path("/dev/shm")
    d = Path(tempfile.mkdtemp(prefix="foldmoe-test-", dir=base)) if base.is_dir() else tmp_path / "shm"
    d.mkdir(exist_ok=True)
    monkeypatch.setenv("FOLDMOE_SHM_DIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def fake_writer():
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}"
    sock.close(linger=0)


def receive(sock: zmq.Socket) -> tuple[bytes, list[pb.ShardHeader], dict[str, torch.Tensor]]:
    headers, tensors = [], {}
    while True:
        assert sock.poll(10_000), "the snapshotter sent nothing"
        identity, *frames = sock.recv_multipart()
        _, header, part = wire.decode(frames, pb.ShardHeader)
        headers.append(header)
        tensors.update(part)
        if header.part == header.num_parts - 1:
            return identity, headers, tensors


def answer(sock: zmq.Socket, identity: bytes, step: int) -> None:
    sock.send_multipart([identity, *wire.encode("ckpt.committed", pb.SaveResult(step=step, path=f"/ck/{step}"))])


def test_prepared_buffers_are_reused_by_every_save_and_unlinked_at_close(fake_writer, shm):
    sock, endpoint = fake_writer
    snap = Snapshotter(endpoint)
    state = {"w": torch.randn(64, 32), "b": torch.randn(7).to(torch.bfloat16), "n": torch.tensor(3)}
    snap.prepare({n: TensorSpec.of(t) for n, t in state.items()}, background=False)
    (arena_file,) = list(shm.iterdir())
    assert arena_file.name.startswith(SHM_PREFIX)
    for step in (1, 2, 3):
        state["w"].add_(1)
        assert snap.save(step, state)
        identity, _, got = receive(sock)
        assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"]) and got["n"].tolist() == [3]
        answer(sock, identity, step)
        snap.wait(10)
    assert snap.unprepared_saves == 0 and list(shm.iterdir()) == [arena_file]  # the same buffers, three times
    snap.save(4, {"w": torch.randn(3)})  # the state changed shape: new buffers, and the save says so
    identity, _, _ = receive(sock)
    answer(sock, identity, 4)
    snap.wait(10)
    assert snap.unprepared_saves == 1
    snap.close()
    assert list(shm.iterdir()) == []


def test_two_host_buffers_let_a_second_save_start_while_the_first_is_being_written(fake_writer, shm):
    sock, endpoint = fake_writer
    snap = Snapshotter(endpoint, on_busy="skip", host_buffers=2)
    snap.prepare({"x": torch.zeros(1000)}, background=False)
    assert snap.save(1, {"x": torch.full((1000,), 1.0)})
    assert not snap.busy
    assert snap.save(2, {"x": torch.full((1000,), 2.0)})  # step 1 unanswered, yet accepted: its own buffer
    assert snap.busy and snap.save(3, {"x": torch.zeros(1000)}) is False
    first, _, got1 = receive(sock)
    answer(sock, first, 1)  # the sender sends step 2 once step 1 is answered
    second, headers, got2 = receive(sock)
    assert headers[0].step == 2 and got1["x"][0] == 1.0 and got2["x"][0] == 2.0  # neither overwrote the other
    answer(sock, second, 2)
    assert snap.wait(10) == "/ck/2" and snap.unprepared_saves == 0
    snap.close()


def test_without_a_shared_memory_directory_the_buffers_are_private_and_still_saved(fake_writer, monkeypatch, tmp_path):
    monkeypatch.setenv("FOLDMOE_SHM_DIR", str(tmp_path / "missing"))
    sock, endpoint = fake_writer
    snap = Snapshotter(endpoint)
    snap.save(1, {"x": torch.arange(5.0)})
    identity, headers, got = receive(sock)
    assert headers[0].shm_path == "" and torch.equal(got["x"], torch.arange(5.0))
    answer(sock, identity, 1)
    snap.wait(10)
    snap.close()


def test_snapshot_files_and_writer_probes_of_dead_processes_are_removed(shm):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = shm / f"{SHM_PREFIX}pid{dead.pid}-rank0-abc"
    mine = shm / f"{SHM_PREFIX}pid{os.getpid()}-rank0-def"
    other = shm / "someone-elses-file"
    stale_probe = shm / f"foldmoe-writer-pid{dead.pid}-0123456789ab.probe"
    for p in (stale, mine, other, stale_probe):
        p.write_bytes(b"x")
    assert remove_stale_files() == [stale]
    path, token = make_shm_probe()  # a starting writer clears probes of writers that were killed
    assert Path(path).read_text() == token
    assert sorted(p.name for p in shm.iterdir()) == sorted([mine.name, other.name, Path(path).name])


def start_writer(ckpt: Path, run: str, shm_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.checkpointer.writer", f"checkpoint.dir={ckpt}",
                             f"run.name={run}"], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "REDIS_URL": REDIS, "FOLDMOE_SHM_DIR": str(shm_dir)})


@pytest.mark.parametrize("writer_sees_our_shm", [True, False])
def test_a_writer_that_sees_our_shared_memory_reads_the_snapshot_in_place(tmp_path, shm, writer_sees_our_shm):
    run, ckpt = f"test-ckpt-{uuid.uuid4().hex[:8]}", tmp_path / "ckpt"
    elsewhere = tmp_path / "other-shm"  # a writer whose /dev/shm is not ours (another container on this host)
    elsewhere.mkdir()
    writer = start_writer(ckpt, run, shm if writer_sees_our_shm else elsewhere)
    try:
        registry = Registry(REDIS, run)
        registry.wait_for("checkpointer", timeout=30)
        snaps = [Snapshotter(registry=registry, rank=r, world_size=2, part_bytes=4096) for r in range(2)]
        full = torch.randn(64, 48)
        for step in (1, 2):
            full.mul_(2)
            for r, snap in enumerate(snaps):
                snap.save(step, {"w": Shard(full[32 * r:32 * (r + 1)], (64, 48), (32 * r, 0)),
                                 "scale": Shard(torch.tensor(float(step)), replicated=True, writer=r == 0)})
            assert [snap.wait(30) for snap in snaps] == [str(ckpt / f"step_{step:08d}")] * 2
            assert [s.last_shared for s in snaps] == [writer_sees_our_shm] * 2
            with load_checkpoint(ckpt / f"step_{step:08d}") as c:
                assert torch.equal(c.read("w"), full) and c.read("scale").item() == step
                assert len(c.manifest.files) > 2  # 6 KiB per rank in 4 KiB parts: several files each
        for snap in snaps:
            snap.close()
    finally:
        writer.terminate()
        _, err = writer.communicate(timeout=20)
    assert writer.returncode == 0, err
    assert list(elsewhere.iterdir()) == [] and not any(p.name.endswith(".probe") for p in shm.iterdir())


def test_the_writer_writes_the_parts_of_a_save_on_several_threads(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path, keep_last=2)
    writer = Writer(store, None, write_threads=4)
    active, peak, lock = [0], [0], threading.Lock()
    real = store.write_part

    def slow_write(*args):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.2)
        try:
            return real(*args)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(store, "write_part", slow_write)
    stop = threading.Event()
    thread = threading.Thread(target=writer.serve, args=(stop,), daemon=True)
    thread.start()
    snap = Snapshotter(writer.endpoint, part_bytes=4096)
    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(8)}  # 8 parts of 4 KiB
    start = time.perf_counter()
    snap.save(1, state)
    snap.wait(30)
    elapsed = time.perf_counter() - start
    snap.close()
    stop.set()
    thread.join(10)
    assert peak[0] >= 3 and elapsed < 8 * 0.2  # serial writing would take 1.6 s
    with load_checkpoint(tmp_path / "step_00000001") as c:
        assert all(torch.equal(c.read(n), t) for n, t in state.items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locking host memory needs a CUDA device")
def test_cuda_a_directory_cuda_cannot_page_lock_falls_back_and_leaves_no_cuda_error(tmp_path, monkeypatch):
    """CUDA refuses to page-lock a shared mapping of a disk file; the arena then pins anonymous memory instead. The
    refused cudaHostRegister must not stay behind as the thread's CUDA error: PyTorch would report it from the next
    kernel launch ("CUDA error: invalid argument" in an unrelated operation; seen in a training step's model init)."""
    disk = tmp_path / "not-tmpfs"
    disk.mkdir()
    monkeypatch.setenv("FOLDMOE_SHM_DIR", str(disk))
    torch.ones(1, device="cuda")  # CUDA initialised before the arena's calls
    arena = HostArena({"w": TensorSpec((1024, 1024), torch.float32)}, pin=True)
    try:
        if arena.shared:
            pytest.skip(f"{tmp_path} is on a filesystem CUDA can page-lock; this test needs one it refuses")
        assert arena.views["w"].is_pinned()
        torch.empty(16, device="cuda").normal_()  # raised the stale error before clear_cuda_error
        torch.cuda.synchronize()
    finally:
        arena.close()
    assert not list(disk.iterdir())  # the refused file was unlinked


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the asynchronous device-to-host copy needs a CUDA device")
@pytest.mark.parametrize("stage_on_device", [False, True])
def test_cuda_save_returns_before_the_copy_and_the_next_optimizer_step_cannot_change_the_snapshot(fake_writer, shm,
                                                                                                  stage_on_device):
    """With device staging the fence waits only for the HBM copy: the step may overwrite `p` while the host copy
    still drains the staging buffer, and the snapshot must still hold the values from before the step."""
    sock, endpoint = fake_writer
    p = torch.nn.Parameter(torch.randn(64 << 20, device="cuda"))  # 256 MiB: the copy takes milliseconds
    opt = torch.optim.SGD([p], lr=1.0)
    opt.register_step_pre_hook(lambda *_: snap.fence())
    snap = Snapshotter(endpoint, stage_on_device=stage_on_device)
    snap.prepare({"p": p}, background=False)
    expected = p.detach().clone()
    torch.cuda._sleep(1_000_000_000)  # keep the training stream busy (~0.5 s): the copies queue behind it
    snap.save(1, {"p": p})
    assert not torch.cuda.current_stream().query()  # save returned without waiting for the stream, let alone the copy
    p.grad = torch.ones_like(p)
    opt.step()  # ordered after the copy (or, staged, after the device copy) by the fence
    identity, _, got = receive(sock)
    answer(sock, identity, 1)
    snap.wait(30)
    assert torch.equal(got["p"], expected.cpu()) and snap.last_copy_s > 0
    assert not torch.equal(p.detach(), expected)  # the step did run
    snap.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the asynchronous device-to-host copy needs a CUDA device")
@pytest.mark.parametrize("stage_on_device", [False, True])
def test_cuda_the_training_stream_does_not_wait_for_a_checkpoint_copy(fake_writer, shm, stage_on_device):
    """A step's values go to the host while a save drains. Every device-to-host copy waits for the save's (the copy
    engine serves them in order; measured on an H100), so on the training stream the values' copy held every kernel
    queued after it until the whole state was on the host (~0.45 s per save of a 25 GB state). They are copied on a
    stream of their own: the training stream goes on, and the snapshotter says it is copying."""
    from services.trainer.metrics import StepValues

    sock, endpoint = fake_writer
    state = {f"w{i}": torch.randn(64 << 20, device="cuda") for i in range(16)}  # 4 GiB: ~80 ms at ~50 GB/s
    snap = Snapshotter(endpoint, stage_on_device=stage_on_device)
    snap.prepare(state, background=False)
    x = torch.ones(1024, device="cuda")
    StepValues(loss=x.sum()).read()
    x.add_(0)  # every kernel below loaded once before: a kernel's first launch loads its module, which waits for the copy
    torch.cuda.synchronize()
    snap.save(1, state)
    time.sleep(0.01)  # the copier thread has queued its first chunks
    assert snap.copying
    values = StepValues(loss=x.sum())
    x.add_(1)  # the next step's work, queued after the values' copy
    queued = torch.cuda.Event()
    queued.record()
    queued.synchronize()
    assert snap.last_copy_s == 0.0 and snap.copying  # the training stream got here while the save still copies
    assert float(values.read()["loss"]) == 1024.0
    snap.fence()  # as the next optimizer step would
    identity, _, got = receive(sock)
    answer(sock, identity, 1)
    snap.wait(60)
    assert not snap.copying and snap.last_copy_s > 0
    assert all(torch.equal(got[n], t.cpu()) for n, t in state.items())
    snap.close()
