"""The checkpoint writer service end to end: a writer process, trainer ranks saving through Snapshotters.

Specification: a tensor split by rows over 2 ranks is committed as one checkpoint that loads back whole and in any
slice; `latest` points at the newest commit (also in Redis); retention keeps the last `keep_last` plus the ones
marked keep; the gRPC service lists, describes, keeps and deletes; an error names its cause to every rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import checkpointer_pb2 as pb
from proto import checkpointer_pb2_grpc as pb_grpc
from services.checkpointer.layout import STORE_ID
from services.checkpointer.load import find_latest_valid, load_checkpoint
from services.checkpointer.shard import Shard
from services.checkpointer.snapshot import SaveError, Snapshotter
from services.common import grpc_server
from services.common.registry import Registry

ROOT = Path(__file__).resolve().parent.parent
REDIS = "redis://127.0.0.1:6379"


def start_writer(tmp: Path, run: str, keep_last: int = 2, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "services.checkpointer.writer", f"checkpoint.dir={tmp / 'ckpt'}",
         f"checkpoint.keep_last={keep_last}", f"run.name={run}"],
        cwd=ROOT, env={**os.environ, "REDIS_URL": REDIS, **(env or {})}, stderr=subprocess.PIPE, text=True)


def stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    return err


@pytest.fixture
def service(tmp_path):
    run = f"test-ckpt-{uuid.uuid4().hex[:8]}"
    proc = start_writer(tmp_path, run)
    registry = Registry(REDIS, run)
    try:
        (record,) = registry.wait_for("checkpointer", timeout=30)
        yield registry, record, tmp_path / "ckpt"
    finally:
        err = stop(proc)
        assert proc.returncode == 0, err


def row_shards(full: torch.Tensor, rank: int, world: int) -> Shard:
    rows = full.shape[0] // world
    return Shard(full[rank * rows:(rank + 1) * rows], tuple(full.shape), (rank * rows, 0))


def save_all(snaps: list[Snapshotter], step: int, state: dict[str, torch.Tensor]) -> list[str]:
    """Every rank saves its rows of each tensor plus the replicated `bias` (written by rank 0 only)."""
    for rank, snap in enumerate(snaps):
        shards = {name: row_shards(t, rank, len(snaps)) for name, t in state.items() if name != "bias"}
        shards["bias"] = Shard(state["bias"], replicated=True, writer=rank == 0)
        shards[f"rng/rank{rank}"] = torch.get_rng_state()  # a per-rank full tensor
        if rank == 0:
            shards["loss_scale"] = torch.tensor(float(step))  # a 0-d tensor from one rank
        assert snap.save(step, shards, {"step": step, "rank": rank, "data": {"position": 100 * step + rank}})
    return [snap.wait(30) for snap in snaps]


def make_state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(8, 6, generator=g), "emb": torch.randn(10, 4, generator=g).to(torch.bfloat16),
            "count": torch.arange(4, dtype=torch.int64).reshape(4, 1) + step, "bias": torch.randn(6, generator=g)}


def test_two_ranks_row_sharded_save_commits_and_reads_back_whole_and_sliced(service):
    registry, _, ckpt = service
    snaps = [Snapshotter(registry=registry, rank=r, world_size=2) for r in range(2)]
    try:
        paths = save_all(snaps, 10, make_state(10))
    finally:
        for s in snaps:
            s.close()
    assert paths == [str(ckpt / "step_00000010")] * 2
    assert find_latest_valid(ckpt) == ckpt / "step_00000010"
    assert (ckpt / "latest").read_text().strip() == "step_00000010"
    assert registry.get_state("checkpoint/latest")["step"] == 10
    state = make_state(10)
    with load_checkpoint(ckpt / "step_00000010") as c:
        assert c.step == 10
        assert c.extra == {"step": 10, "rank": 0, "data": {"position": 1000}}
        assert [e["data"]["position"] for e in c.extras] == [1000, 1001]
        assert c.names() == ["bias", "count", "emb", "loss_scale", "rng/rank0", "rng/rank1", "w"]
        assert c.read("loss_scale").shape == () and c.read("loss_scale").item() == 10.0
        assert torch.equal(c.read("rng/rank1"), torch.get_rng_state())
        for name, t in state.items():
            assert c.global_shape(name) == tuple(t.shape)
            assert torch.equal(c.read(name), t), name
        # A slice straddling the two ranks' rows, as a different layout would ask for it.
        assert torch.equal(c.read("w", offsets=(3, 1), shape=(3, 4)), state["w"][3:6, 1:5])
        assert torch.equal(c.read("emb", offsets=(5, 0), shape=(1, 4)), state["emb"][5:6])


def test_retention_keeps_last_n_plus_marked_and_grpc_lists_describes_deletes(service):
    registry, record, ckpt = service
    channel = grpc.insecure_channel(record["grpc"])
    stub = pb_grpc.CheckpointerStub(channel)
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="foldmoe.v1.Checkpointer"))
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    snaps = [Snapshotter(registry=registry, rank=r, world_size=2) for r in range(2)]
    try:
        save_all(snaps, 1, make_state(1))
        assert stub.Keep(pb.KeepRequest(step=1, keep=True)).checkpoint.keep
        for step in (2, 3, 4):
            save_all(snaps, step, make_state(step))
    finally:
        for s in snaps:
            s.close()
    listed = stub.List(pb.ListRequest(verify=True)).checkpoints
    assert [(c.step, c.keep, c.latest, c.valid) for c in listed] == [(1, True, False, True), (3, False, False, True),
                                                                      (4, False, True, True)]
    described = stub.Describe(pb.DescribeRequest(step=-1))
    assert described.checkpoint.step == 4 and described.checkpoint.world_size == 2
    w = next(t for t in described.tensors if t.name == "w")
    assert (w.dtype, list(w.global_shape), w.num_shards) == ("float32", [8, 6], 2)
    assert '"step": 4' in described.extra_json
    assert stub.SaveStatus(pb.SaveStatusRequest()).saves_committed == 4
    reply = stub.Delete(pb.DeleteRequest(step=4))
    assert reply.deleted and reply.latest_step == 3
    assert (ckpt / "latest").read_text().strip() == "step_00000003"
    with pytest.raises(grpc.RpcError) as err:
        stub.Describe(pb.DescribeRequest(step=4))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    channel.close()


def test_a_save_with_inconsistent_shards_fails_on_every_rank_with_the_reason(service):
    registry, _, ckpt = service
    snaps = [Snapshotter(registry=registry, rank=r, world_size=2) for r in range(2)]
    try:
        full = torch.randn(4, 2)
        # Both ranks claim rows 0-1: rows 2-3 are missing, so the commit must refuse.
        for snap in snaps:
            snap.save(5, {"w": Shard(full[:2], (4, 2), (0, 0))})
        for snap in snaps:
            with pytest.raises(SaveError, match=r"'w'.*cover 4 of 8 elements"):
                snap.wait(30)
    finally:
        for s in snaps:
            s.close()
    assert find_latest_valid(ckpt) is None
    assert [p.name for p in ckpt.iterdir()] == [STORE_ID]  # the failed staging directory is gone too


def test_the_writer_process_exits_cleanly_on_sigterm_and_unregisters(tmp_path):
    run = f"test-ckpt-{uuid.uuid4().hex[:8]}"
    proc = start_writer(tmp_path, run)
    registry = Registry(REDIS, run)
    registry.wait_for("checkpointer", timeout=30)
    err = stop(proc)
    assert proc.returncode == 0, err
    assert registry.lookup("checkpointer") == []


def test_the_writer_stops_within_the_launchers_grace_while_health_probes_keep_arriving(tmp_path):
    # The launcher probes every service's gRPC health while it runs. A writer that left its gRPC server shutting down
    # when it returned from main could take a probe after the interpreter had shut its thread pools: gRPC's serving
    # thread then died ("cannot schedule new futures after shutdown") and the process never exited. That hung 3 of 20
    # stops on this 2-core host with 8 probing threads, so 10 stops miss a regression about 20% of the time.
    for i in range(10):
        run = f"test-ckpt-stop-{uuid.uuid4().hex[:8]}"
        proc = start_writer(tmp_path / str(i), run)
        (record,) = Registry(REDIS, run).wait_for("checkpointer", timeout=30)
        done = threading.Event()

        def probe(address=record["grpc"]):
            while not done.is_set():
                grpc_server.check(address, timeout=0.5)

        probes = [threading.Thread(target=probe, daemon=True) for _ in range(8)]
        for t in probes:
            t.start()
        try:
            proc.send_signal(signal.SIGTERM)
            try:
                _, err = proc.communicate(timeout=10)  # the launcher's grace period
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
                pytest.fail(f"stop {i}: the writer did not exit within 10s of SIGTERM; its stderr:\n{err[-4000:]}")
            assert proc.returncode == 0, err
        finally:
            done.set()
            for t in probes:
                t.join()
