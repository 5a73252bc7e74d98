"""Surviving a restart of the dataloader service (issue #9).

Specification: when the service dies (kill -9) and a new one registers, every trainer rank's `DataClient` finds it in
the registry, resumes it from the last step it received in full, and the steps `next_step` returns are exactly those of
an undisturbed run: none lost, none repeated, a partly received step received again whole. Ranks that stand a step
apart when the service dies all keep being served, whichever of them reaches the new service first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from services.common.config import load_config
from services.dataloader.client import DataClient
from services.dataloader.server import DataLoaderServer
from tests.test_dataloader_service import CORPUS, REDIS_URL, ROOT, clients, registry, same, steps  # noqa: F401

DP, TP = 2, 2


def overrides(tmp_path, *extra):
    return [f"data.corpus=[{CORPUS}]", f"data.dataset_dir={tmp_path / 'ds'}", "data.seq_len=64",
            "data.micro_batch_size=2", "data.grad_accum=2", "data.prefetch=3", "data.packing_window=32", *extra]


def undisturbed(cfg, n):
    """[rank][step] micro-batch lists of a service nobody restarts."""
    server = DataLoaderServer(cfg).start()
    try:
        cls = [DataClient(server.zmq_endpoint, server.grpc_endpoint, dp_rank=r // TP, dp_size=DP, grad_accum=2,
                          rank=r, group_size=TP, prefetch=3, timeout=20) for r in range(DP * TP)]
        got = steps(cls, n)
        for c in cls:
            c.close()
    finally:
        server.stop()
    return [[got[s][r] for s in range(n)] for r in range(DP * TP)]


def start_service(tmp_path, registry, *extra) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "services.dataloader.server", *overrides(tmp_path, *extra),
                             f"run.name={registry.run}"], cwd=ROOT, env={**os.environ, "REDIS_URL": REDIS_URL},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not any(r["pid"] == proc.pid for r in registry.lookup("dataloader")):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the dataloader service did not register within 30 s"
        time.sleep(0.1)
    return proc


def finish(cls, seen, n):
    """Round-robin, as synchronous trainer ranks advance: the service buffers only a few steps ahead of the slowest."""
    while any(len(mine) < n for mine in seen):
        for c, mine in zip(cls, seen):
            if len(mine) < n:
                mine.append(c.next_step())


def assert_same_steps(seen, reference):
    for rank, (mine, ref) in enumerate(zip(seen, reference, strict=True)):
        assert len(mine) == len(ref)
        for step, (a, b) in enumerate(zip(mine, ref)):
            assert len(a) == len(b) and all(same(x, y) for x, y in zip(a, b)), (rank, step)


def test_a_service_killed_9_mid_stream_and_restarted_loses_and_repeats_no_step(tmp_path, registry):
    cfg = load_config(None, overrides(tmp_path, f"run.name={registry.run}"))
    k, n = 3, 9
    reference = undisturbed(cfg, n)
    first = start_service(tmp_path, registry)
    second = None
    try:
        cls = clients(registry, cfg, dp_size=DP, tp=TP)
        seen = [[] for _ in cls]
        for _ in range(k):
            for c, mine in zip(cls, seen):
                mine.append(c.next_step())
        seen[0].append(cls[0].next_step())  # rank 0 is a step ahead when the service dies
        time.sleep(0.3)  # prefetched micro-batches (an odd number of credits: part of a step) land in the sockets
        first.kill()
        first.wait()
        second = start_service(tmp_path, registry)
        finish(cls, seen, n)
        assert_same_steps(seen, reference)
        assert all(c.reconnects == 1 for c in cls)
        assert {c.grpc_endpoint for c in cls} == {r["grpc"] for r in registry.lookup("dataloader")
                                                    if r["pid"] == second.pid}
        assert len({json.dumps(c.state()) for c in cls}) == 1
        for c in cls:
            c.close()
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("ahead_first", [True, False], ids=["ahead-rank-reconnects-first", "behind-rank-first"])
def test_ranks_a_step_apart_all_stay_served_by_the_restarted_service(tmp_path, registry, ahead_first):
    cfg = load_config(None, overrides(tmp_path, "data.prefetch=1", f"run.name={registry.run}"))
    n = 7
    reference = undisturbed(cfg, n)
    server = DataLoaderServer(cfg, registry).start()
    try:
        cls = clients(registry, cfg, dp_size=DP, tp=TP)
        seen = [[c.next_step(), c.next_step()] for c in cls]
        for r in (0, 1):  # dp rank 0 (ranks 0 and 1) is a step ahead
            seen[r].append(cls[r].next_step())
        server.stop()
        server = DataLoaderServer(cfg, registry).start()
        order = [0, 1, 2, 3] if ahead_first else [2, 3, 0, 1]
        for r in order:  # the first call on each rank finds the service gone and reconnects
            seen[r].append(cls[r].next_step())
        finish(cls, seen, n)
        assert_same_steps(seen, reference)
        assert all(c.reconnects == 1 for c in cls)
        assert server.engine.generation == 1  # one stream: no rank was cut off by another's resume
        for c in cls:
            c.close()
    finally:
        server.stop()


def test_resumes_on_the_same_stream_keep_its_generation_and_a_mislabelled_state_starts_a_new_one(tmp_path):
    cfg = load_config(None, overrides(tmp_path))
    server = DataLoaderServer(cfg).start()
    try:
        c = DataClient(server.zmq_endpoint, server.grpc_endpoint, dp_rank=0, dp_size=1, grad_accum=2, timeout=10)
        states = [c.state()]
        for _ in range(4):
            c.next_step()
            states.append(c.state())  # states[i]: before step i
        engine = server.engine
        with engine.lock:  # the serving loop produces nothing in between
            generation = engine.generation
            assert engine.resume(json.dumps(states[1]), 1) == (1, True)  # dropped already: rebuilt, rewound
            assert engine.resume(json.dumps(states[3]), 1) == (3, False)  # two steps ahead: reached on demand
            assert engine.resume(json.dumps(states[2]), 1) == (2, False)
            assert engine.generation == generation and engine.joinable == 3
            assert engine.resume(json.dumps({**states[2], "step": 3}), 1) == (3, True)  # a position of another step
            assert engine.generation == generation + 1
        c.close()
    finally:
        server.stop()


def test_a_client_gives_up_with_the_cause_when_no_service_comes_back(tmp_path, registry):
    cfg = load_config(None, overrides(tmp_path, f"run.name={registry.run}"))
    server = DataLoaderServer(cfg, registry).start()
    (c,) = clients(registry, cfg, dp_size=1, tp=1)
    c.timeout = 2
    c.next_step()
    server.stop()
    with pytest.raises(Exception, match="stopped answering and none came back within 2s.*restart the dataloader"):
        for _ in range(10):  # prefetched micro-batches are used up first
            c.next_step()
    c.close()
