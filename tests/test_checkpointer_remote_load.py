"""Resuming through the checkpointer, for trainer hosts that do not mount checkpoint.dir.

Specification:
- gRPC `Open` names the newest committed checkpoint that verifies (skipping a corrupt newer one, refusing when none
  does); the load socket (ZMQ) answers any box of any tensor, assembled from whichever saved pieces overlap it: every
  box read through the service equals the same box read from the directory, for every dtype, 0-d tensors, tensors
  split over several saved pieces and a 12 MiB one;
- a box outside its tensor is a ValueError and an unknown tensor a KeyError, as for a local read; an unreachable or
  token-less service, a token-less box request and a checkpointer without a load socket are CheckpointErrors naming
  the address and the cause;
- the trainer reads its checkpoint.dir itself only when it holds the directory a registered checkpointer writes (the
  `.store_id` it registered), else through that checkpointer; ranks that read the directory themselves leave the
  checksums to the checkpointer, which reads the files once for all of them;
- a source owns the gRPC channel it opens and closes it on `close()` or leaving a `with` block (a later call opens a new
  one); a directory source owns the service source verifying for it, and holds its channel only while asking it for the
  newest checkpoint;
- end to end: a trainer whose checkpoint.dir does not exist saves through the writer and a second one resumes at the
  right step through the service, never creating that directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import grpc
import pytest
import torch

from proto import checkpointer_pb2 as pb
from proto import checkpointer_pb2_grpc as pb_grpc
from services.checkpointer.box_server import BoxServer
from services.checkpointer.control import serve_grpc
from services.checkpointer.layout import CheckpointError, read_store_id
from services.checkpointer.load import DirectorySource, load_checkpoint
from services.checkpointer.remote import ServiceSource
from services.checkpointer.store import CheckpointStore
from services.common import grpc_server
from services.common.config import load_config
from services.common.registry import Registry

ROOT = Path(__file__).resolve().parent.parent
REDIS = "redis://127.0.0.1:6379"


def tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(6, 10, generator=g),  # saved as four pieces, 3 x 5 each
        "big": torch.randn(3, (1 << 20) + 77, generator=g),  # 12 MiB: a frame larger than any socket buffer
        "half": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "count": torch.tensor(step, dtype=torch.int64),  # 0-d
        "mask": torch.rand(4, 4, generator=g) > 0.5,
    }


def commit(store: CheckpointStore, step: int) -> dict[str, torch.Tensor]:
    """Step `step` saved by two "ranks": rank 0 the left half of every column split of `w` and the rest, rank 1 the
    right half of `w`."""
    state = tensors(step)
    w = state["w"]
    pieces = [{f"w#{i}": (w[r:r + 3, :5], [0 + r, 0]) for i, r in enumerate((0, 3))},
              {f"w#{i}": (w[r:r + 3, 5:], [r, 5]) for i, r in enumerate((0, 3))}]
    for name in ("big", "half", "count", "mask"):
        pieces[0][name] = (state[name], [0] * state[name].dim())
    for rank, mine in enumerate(pieces):
        part = store.write_part(step, rank, 0, {k: t.contiguous() for k, (t, _) in mine.items()},
                                {k: (list(state[k.split("#")[0]].shape), off) for k, (_, off) in mine.items()})
        store.write_rank_record(step, rank, [part], {"step": step, "rank": rank})
    store.commit("remote-test", step, 2)
    return state


@pytest.fixture
def served(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", keep_last=0)
    server, address = serve_grpc(store, writer=None, token="sesame")
    boxes = BoxServer(store, token="sesame").start()
    source = ServiceSource(address, token="sesame", dir=str(store.root), load=boxes.endpoint)
    try:
        yield store, source
    finally:
        source.close()
        grpc_server.stop(server, grace=0.5)
        boxes.close()


def test_no_checkpoint_is_none_through_the_service_as_in_the_directory(served):
    store, source = served
    assert source.newest() is None and DirectorySource(store.root).newest() is None
    assert source.saved() == []


def test_every_box_read_through_the_service_equals_the_directorys(served):
    store, source = served
    commit(store, 1)
    state = commit(store, 2)
    assert source.saved() == ["step_00000002", "step_00000001"]
    remote = source.newest()
    assert remote.step == 2 and remote.extra == {"step": 2, "rank": 0}
    with load_checkpoint(store.final_dir(2)) as local:
        assert remote.names() == local.names() == sorted(state)
        for name in remote.names():
            assert remote.global_shape(name) == local.global_shape(name)
            assert remote.dtype(name) == local.dtype(name) == state[name].dtype
            assert torch.equal(remote.read(name), state[name]), name
        # boxes that cut across the saved pieces of `w`, and a slice of `big` that spans a chunk boundary
        boxes = [((1, 2), (4, 6)), ((2, 4), (2, 2)), ((0, 0), (6, 10)), ((5, 9), (1, 1)), ((3, 0), (0, 4))]
        for offsets, shape in boxes:
            got = remote.read("w", offsets, shape)
            assert torch.equal(got, local.read("w", offsets, shape)), (offsets, shape)
        cols = state["big"].shape[1]
        assert torch.equal(remote.read("big", (1, cols // 2), (2, cols - cols // 2)), state["big"][1:, cols // 2:])


def test_ranks_that_share_the_directory_read_it_and_the_service_verifies_once_for_all(served, monkeypatch):
    from services.checkpointer import load

    store, source = served
    commit(store, 1)
    state = commit(store, 2)
    full_checks, real_verify = [], load.verify

    def verify(path, checksums=True):
        if checksums:
            full_checks.append(path)
        return real_verify(path, checksums)

    monkeypatch.setattr(load, "verify", verify)
    ranks = [DirectorySource(store.root, verified_by=source) for _ in range(4)]
    opened = [rank.newest() for rank in ranks]
    assert [c.path for c in opened] == [store.final_dir(2)] * 4  # the files themselves, not the service's stream
    assert torch.equal(opened[0].read("w", (1, 2), (4, 6)), state["w"][1:5, 2:8])
    assert full_checks == [store.final_dir(2)]  # one sha256 pass over the newest checkpoint, for four ranks
    shard = next(store.final_dir(2).glob("rank00001_*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-8] + b"garbage!")
    assert DirectorySource(store.root, verified_by=source).newest().path == store.final_dir(1)


def test_bad_requests_raise_what_a_local_read_raises(served):
    store, source = served
    commit(store, 1)
    remote = source.newest()
    with pytest.raises(ValueError, match="outside tensor 'w'"):
        remote.read("w", (4, 0), (3, 10))
    with pytest.raises(KeyError, match="'nope' is not in checkpoint"):
        remote.read("nope")


def test_open_skips_a_corrupt_newer_checkpoint_and_refuses_when_none_verifies(served):
    store, source = served
    commit(store, 1)
    commit(store, 2)
    shard = next(store.final_dir(2).glob("rank00001_*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-8] + b"garbage!")
    assert source.newest().step == 1
    assert source.newest(checksums=False).step == 2  # manifests only: what `init_from` asks
    shard = next(store.final_dir(1).glob("rank00000_*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-8] + b"garbage!")
    with pytest.raises(CheckpointError, match=r"FAILED_PRECONDITION.*2 checkpoint\(s\) and none verifies.*step_0+2"):
        source.newest()


def test_an_unreachable_or_unauthenticated_service_is_an_error_naming_it(served):
    store, source = served
    commit(store, 1)
    with pytest.raises(CheckpointError, match="UNAUTHENTICATED"):
        ServiceSource(source.address).newest()
    dead = ServiceSource("127.0.0.1:1")
    with pytest.raises(CheckpointError, match=r"checkpointer at 127.0.0.1:1.*did not answer.*reachable from this host"):
        dead.saved()
    dead.close()
    opened = source.newest()
    with ServiceSource(source.address, load=source.load) as tokenless:
        with pytest.raises(CheckpointError, match=r"reading 'w' of step 1 failed: .*load.*(token|auth)"):
            RemoteCheckpointOf(tokenless, opened).read("w")
    with ServiceSource(source.address, token="sesame") as no_socket:
        with pytest.raises(CheckpointError, match="registered no load socket"):
            RemoteCheckpointOf(no_socket, opened).read("w")


def RemoteCheckpointOf(source: ServiceSource, opened):
    """`opened` (a RemoteCheckpoint) read through another source."""
    opened.source = source
    return opened


@pytest.fixture
def channels(monkeypatch):
    """Every channel opened from here on, each with a stub made while it was open (a stub made on a closed channel
    crashes grpc)."""
    opened, real = [], grpc.insecure_channel

    def insecure_channel(*args, **kwargs):
        channel = real(*args, **kwargs)
        opened.append(pb_grpc.CheckpointerStub(channel))
        return channel

    monkeypatch.setattr(grpc, "insecure_channel", insecure_channel)
    return opened


def closed(stub: pb_grpc.CheckpointerStub) -> bool:
    try:
        stub.List(pb.ListRequest(), timeout=5)
    except ValueError as e:  # grpc's "Cannot invoke RPC on closed channel!"
        return "closed" in str(e)
    except grpc.RpcError:  # open, and the service refused the token-less call
        return False
    return False


def test_closing_a_service_source_closes_its_channel_and_a_later_call_opens_another(served, channels):
    store, served_source = served
    commit(store, 1)
    with ServiceSource(served_source.address, token="sesame") as source:
        assert source.saved() == ["step_00000001"]
        assert len(channels) == 1 and not closed(channels[0])
    assert closed(channels[0])
    assert source.newest().step == 1  # a closed source still answers, on a channel of its own
    assert len(channels) == 2 and not closed(channels[1])
    source.close()
    source.close()  # twice is harmless
    assert closed(channels[1])


def test_a_directory_source_holds_its_verifiers_channel_only_while_asking_for_the_newest(served, channels):
    store, served_source = served
    commit(store, 1)
    ranks = [DirectorySource(store.root, verified_by=ServiceSource(served_source.address, token="sesame"))
             for _ in range(2)]
    assert [rank.newest().path for rank in ranks] == [store.final_dir(1)] * 2
    assert len(channels) == 2 and all(closed(stub) for stub in channels)
    with ranks[0] as rank:
        assert rank.verified_by.saved() == ["step_00000001"]  # the verifier's channel open again
        assert not closed(channels[2])
    assert closed(channels[2])  # leaving the block closed what the directory source owns
    ranks[1].verified_by.saved()
    ranks[1].close()
    assert closed(channels[3])
    DirectorySource(store.root).close()  # nothing to close without a verifier


def test_the_trainer_reads_its_directory_only_when_it_is_the_checkpointers(tmp_path):
    from services.trainer.checkpointing import checkpoint_source

    run = f"test-source-{uuid.uuid4().hex[:8]}"
    registry = Registry(REDIS, run)
    store = CheckpointStore(tmp_path / "served", keep_last=0)
    beat = registry.register("checkpointer", {"grpc": "127.0.0.1:9", "host": "elsewhere", "dir": str(store.root),
                                              "store_id": store.store_id}, instance="w0")
    try:
        assert read_store_id(store.root) == store.store_id != ""
        assert CheckpointStore(store.root, keep_last=0).store_id == store.store_id  # a second writer keeps the id
        same = checkpoint_source(registry, load_config(None, [f"checkpoint.dir={store.root}"]), 0)
        assert isinstance(same, DirectorySource) and same.verified_by.address == "127.0.0.1:9"
        for view in (tmp_path / "absent", tmp_path / "other"):  # no such directory; another directory of its own id
            if view.name == "other":
                CheckpointStore(view, keep_last=0)
            cfg = load_config(None, [f"checkpoint.dir={view}"])
            source = checkpoint_source(registry, cfg, 0)
            assert isinstance(source, ServiceSource) and source.address == "127.0.0.1:9"
            assert str(store.root) in source.where
        assert not (tmp_path / "absent").exists()
    finally:
        beat.stop()


# ---------------------------------------------------------------- end to end


def run_trainer(tmp_path: Path, run: str, steps: int, metrics: str) -> subprocess.CompletedProcess:
    args = common_overrides(tmp_path, run) + [f"run.steps={steps}", f"checkpoint.dir={tmp_path / 'not-mounted'}",
                                              f"run.metrics_file={tmp_path / metrics}"]
    return subprocess.run([sys.executable, "-m", "services.trainer.train", "--config", "configs/tiny.yaml", *args],
                          cwd=ROOT, env={**os.environ, "REDIS_URL": REDIS}, capture_output=True, text=True,
                          timeout=240)


def common_overrides(tmp_path: Path, run: str) -> list[str]:
    return [f"run.name={run}", f"run.dir={tmp_path / 'run'}", f"data.dataset_dir={tmp_path / 'data'}",
            "checkpoint.interval=2", "optimizer.warmup_steps=1"]


def test_a_trainer_that_does_not_see_the_checkpoint_directory_resumes_through_the_service(tmp_path):
    from services.dataloader.server import DataLoaderServer

    run = f"test-remote-{uuid.uuid4().hex[:8]}"
    served = tmp_path / "served"
    writer = subprocess.Popen([sys.executable, "-m", "services.checkpointer.writer", "--config", "configs/tiny.yaml",
                               *common_overrides(tmp_path, run), f"checkpoint.dir={served}"],
                              cwd=ROOT, env={**os.environ, "REDIS_URL": REDIS}, stderr=subprocess.PIPE, text=True)
    cfg = load_config(str(ROOT / "configs/tiny.yaml"), common_overrides(tmp_path, run))
    registry = Registry(REDIS, run)
    try:
        registry.wait_for("checkpointer", timeout=30)
        runs = []
        for steps, metrics in ((4, "first.jsonl"), (6, "second.jsonl")):
            data = DataLoaderServer(cfg, registry).start()  # a fresh one per trainer, as the launcher starts
            try:
                runs.append(run_trainer(tmp_path, run, steps, metrics))
            finally:
                data.stop()
            assert runs[-1].returncode == 0, runs[-1].stderr[-3000:]
        first, second = runs
        assert "resumed" not in first.stderr
        assert f"resumed from {served / 'step_00000004'} (through the checkpointer at" in second.stderr
        assert [json.loads(line)["step"] for line in (tmp_path / "second.jsonl").read_text().splitlines()] == [5, 6]
        assert CheckpointStore(served, keep_last=0).steps()[-1] == 6
        assert not (tmp_path / "not-mounted").exists()  # the trainer never wrote nor read it
    finally:
        writer.send_signal(signal.SIGTERM)
        _, err = writer.communicate(timeout=30)
        assert writer.returncode == 0, err
