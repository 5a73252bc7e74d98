"""The dataloader service end to end: server + clients over ZMQ/gRPC, registered in the local Redis.

Specification: TP peers (same dp_rank) receive identical micro-batches; a stream resumed from the state saved after step k,
on a restarted server, equals the uninterrupted stream from step k; flow control never sends beyond a client's credits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest
import torch
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import dataloader_pb2 as pb
from services.common import wire
from services.common.config import load_config
from services.common.registry import Registry
from services.dataloader.client import DataClient
from services.dataloader.errors import DataError
from services.dataloader.server import DataLoaderServer

ROOT = Path(__file__).resolve().parent.parent
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")
CORPUS = os.path.join(os.path.dirname(os.__file__), "json", "*.py")


def make_cfg(tmp_path, *extra):
    return load_config(None, [f"data.corpus=[{CORPUS}]", f"data.dataset_dir={tmp_path / 'ds'}", "data.seq_len=64",
                              "data.micro_batch_size=2", "data.grad_accum=2", "data.prefetch=3",
                              "data.packing_window=32", f"run.name=test-dl-{uuid.uuid4().hex[:10]}", *extra])


@pytest.fixture
def registry(tmp_path):
    reg = Registry(REDIS_URL, f"test-dl-{uuid.uuid4().hex[:10]}")
    yield reg
    for key in reg.client.scan_iter(match=f"foldmoe:{reg.run}:*"):
        reg.client.delete(key)


def clients(registry, cfg, dp_size=2, tp=2):
    """One client per trainer rank; rank r has dp_rank r // tp, so ranks 2k and 2k+1 are TP peers."""
    world = dp_size * tp
    return [DataClient.from_registry(registry, r // tp, dp_size, cfg, rank=r, world_size=world, timeout=20)
            for r in range(world)]


def steps(cls, n):
    return [[c.next_step() for c in cls] for _ in range(n)]  # [step][rank][micro] -> tensors


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tp_peers_get_identical_micro_batches_and_dp_ranks_get_different_ones(tmp_path, registry):
    cfg = make_cfg(tmp_path)
    server = DataLoaderServer(cfg, registry).start()
    try:
        cls = clients(registry, cfg)
        got = steps(cls, 5)
        for step in got:
            assert all(len(rank) == cfg.data.grad_accum for rank in step)
            for micro in range(cfg.data.grad_accum):
                assert same(step[0][micro], step[1][micro]) and same(step[2][micro], step[3][micro])
                assert not torch.equal(step[0][micro]["tokens"], step[2][micro]["tokens"])
                assert step[0][micro]["tokens"].shape == (cfg.data.micro_batch_size * cfg.data.seq_len,)
                assert int(step[0][micro]["cp_size"]) == 1
        status = cls[0].status()
        assert status["clients"] == 4 and status["expected_clients"] == 4 and status["efficiency"] > 0.9
        assert status["buffered_steps"] <= server.engine.max_buffered
        assert len({str(c.state()) for c in cls}) == 1  # every rank checkpoints the same position
        for c in cls:
            c.close()
    finally:
        server.stop()


def test_stream_resumed_on_a_restarted_server_equals_the_uninterrupted_stream(tmp_path, registry):
    cfg = make_cfg(tmp_path)
    k, n = 4, 10
    server = DataLoaderServer(cfg, registry).start()
    cls = clients(registry, cfg)
    reference = steps(cls, k)
    saved = [c.state() for c in cls]
    reference += steps(cls, n - k)
    for c in cls:
        c.close()
    server.stop()

    server = DataLoaderServer(cfg, registry).start()
    try:
        cls = clients(registry, cfg)
        assert [c.resume(s) for c, s in zip(cls, saved)] == [k] * 4
        resumed = steps(cls, n - k)
        for i, step in enumerate(resumed):
            for rank in range(4):
                assert all(same(a, b) for a, b in zip(step[rank], reference[k + i][rank])), (k + i, rank)
        for c in cls:
            c.close()
    finally:
        server.stop()


def test_state_saved_under_one_dp_layout_resumes_exactly_under_another(tmp_path, registry):
    cfg = make_cfg(tmp_path)
    server = DataLoaderServer(cfg, registry).start()
    try:
        two = clients(registry, cfg, dp_size=2, tp=1)
        steps(two, 3)
        saved = two[0].state()
        after = steps(two, 2)  # dp rank 0 then dp rank 1 within each step: the order of the global stream
        flat_two = [mb["tokens"] for step in after for rank in step for mb in rank]
        for c in two:
            c.close()
        (one,) = clients(registry, cfg, dp_size=1, tp=1)
        one.resume(saved)
        flat_one = [mb["tokens"] for _ in range(4) for mb in one.next_step()]
        assert all(torch.equal(a, b) for a, b in zip(flat_two, flat_one, strict=True))
        one.close()
    finally:
        server.stop()


def test_state_of_another_stream_is_refused_with_the_reason(tmp_path, registry):
    cfg = make_cfg(tmp_path)
    server = DataLoaderServer(cfg, registry).start()
    try:
        (c,) = clients(registry, cfg, dp_size=1, tp=1)
        c.next_step()
        state = {**c.state(), "seed": cfg.data.seed + 1}
        with pytest.raises(DataError, match="seed=1235 vs 1234"):
            c.resume(state)
        c.close()
    finally:
        server.stop()


def test_server_never_sends_beyond_the_credits_a_client_granted(tmp_path):
    cfg = make_cfg(tmp_path)
    server = DataLoaderServer(cfg).start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.connect(server.zmq_endpoint)
        wire.send(sock, "hello", pb.DataHello(rank=0, dp_rank=0, dp_size=1, group_size=1, start_step=0, credits=1))

        def received(wait_s):
            got = []
            while sock.poll(int(wait_s * 1000)):
                got.append(wire.recv(sock, pb.MicroBatchHeader)[1])
            return got

        assert [(h.step, h.micro) for h in received(0.5)] == [(0, 0)]
        wire.send(sock, "credit", pb.DataCredit(credits=2))
        assert [(h.step, h.micro) for h in received(0.5)] == [(0, 1), (1, 0)]
    finally:
        sock.close(linger=0)
        server.stop()


def test_a_rank_asking_for_an_unknown_step_gets_an_error_naming_the_fix(tmp_path):
    server = DataLoaderServer(make_cfg(tmp_path)).start()
    try:
        c = DataClient(server.zmq_endpoint, server.grpc_endpoint, dp_rank=0, dp_size=1, grad_accum=2, timeout=5)
        c._next_step = 7  # as if it had skipped ResumeFromState
        c._join()
        with pytest.raises(DataError, match="asks for step 7.*ResumeFromState"):
            c.next_step()
        c.close()
    finally:
        server.stop()


def test_unreachable_server_is_reported_with_its_endpoint():
    with zmq.Context.instance().socket(zmq.REP) as probe:  # a free port nobody serves gRPC on
        port = probe.bind_to_random_port("tcp://127.0.0.1")
    c = DataClient(f"tcp://127.0.0.1:{port}", f"127.0.0.1:{port}", dp_rank=0, dp_size=1, grad_accum=1, timeout=1)
    with pytest.raises(DataError, match=f"127.0.0.1:{port} unreachable"):
        c.next_step()
    c.close()


def test_service_process_registers_serves_health_and_exits_cleanly_on_sigterm(tmp_path, registry):
    cfg = make_cfg(tmp_path)
    args = [f"data.corpus=[{CORPUS}]", f"data.dataset_dir={tmp_path / 'ds'}", "data.seq_len=64",
            "data.micro_batch_size=2", "data.grad_accum=2", f"run.name={registry.run}"]
    proc = subprocess.Popen([sys.executable, "-m", "services.dataloader.server", *args], cwd=ROOT,
                            env={**os.environ, "REDIS_URL": REDIS_URL}, stderr=subprocess.PIPE, text=True)
    try:
        (record,) = registry.wait_for("dataloader", 1, timeout=30)
        with grpc.insecure_channel(record["grpc"]) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="foldmoe.v1.DataLoader"), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        (c,) = clients(registry, cfg, dp_size=1, tp=1)
        assert len(c.next_step()) == 2
        c.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, proc.stderr.read()
        deadline = time.monotonic() + 5
        while registry.lookup("dataloader") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert registry.lookup("dataloader") == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_micro_batches_carry_the_static_cp_size_of_the_layout(tmp_path, registry):
    cfg = make_cfg(tmp_path, "parallel.cp=2")
    server = DataLoaderServer(cfg, registry).start()
    try:
        c = DataClient.from_registry(registry, 0, 1, cfg, rank=0, world_size=2, timeout=20)  # CP peer 0 of 2
        assert [int(mb["cp_size"]) for _ in range(3) for mb in c.next_step()] == [2] * 6
        c.close()
    finally:
        server.stop()


def test_a_client_is_held_to_the_credit_cap_whatever_it_asks_for(tmp_path):
    """Credits are uint32: a broken or hostile client asking for 2^32 - 1 made one `pending()` call build micro-batches
    without end under the engine's lock (the serving thread stuck, memory growing until the OS killed the process;
    found by tests/test_ops_endpoint_fuzz.py). A client holds at most MAX_PREFETCH, in its hello and after credits."""
    from services.common.config import MAX_PREFETCH

    server = DataLoaderServer(make_cfg(tmp_path))  # not started: its engine is driven directly
    engine = server.engine
    assert engine.hello(b"stranger", pb.DataHello(rank=0, dp_rank=0, dp_size=1, credits=2**32 - 1)) is None
    assert engine.clients[0].credits == MAX_PREFETCH
    sent = 0
    for _ in range(3 * MAX_PREFETCH):  # as the serving loop does: build what the credits pay for, send, repeat
        batch = engine.pending()
        sent += len(batch)
        if not batch and engine.clients[0].credits == 0:
            break
    assert sent == MAX_PREFETCH
    engine.credit(0, 2**32 - 1)
    engine.credit(0, 5)
    assert engine.clients[0].credits == MAX_PREFETCH
