"""Several dataloader replicas serving one run (`data.replicas`).

Specification: replica r serves the dp ranks with dp_rank % replicas == r; every rank receives exactly the micro-batches
(tokens, CP sizes, states) that one service would send it, also across a restart of one replica; a replica refuses a
rank it does not serve, naming the replica to use; the replicas claim distinct indices in the registry.
"""

from __future__ import annotations

import json

import pytest

from services.common.config import ConfigError, load_config
from services.dataloader.client import DataClient
from services.dataloader.errors import DataError
from services.dataloader.server import DataLoaderServer
from services.dataloader.stream import StepStream
from tests.test_dataloader_restart import assert_same_steps, finish, overrides
from tests.test_dataloader_service import clients, registry, same  # noqa: F401
from tests.test_dataloader_stream import dynamic_cp_cfg, open_all

DP = 4


def single_service_steps(cfg, n):
    """[rank][step] of one service serving every dp rank (the reference the replicas must reproduce)."""
    server = DataLoaderServer(cfg).start()
    try:
        cls = [DataClient(server.zmq_endpoint, server.grpc_endpoint, dp_rank=r, dp_size=DP, grad_accum=2, rank=r,
                          prefetch=3, timeout=20) for r in range(DP)]
        seen = [[] for _ in cls]
        finish(cls, seen, n)
        states = {json.dumps(c.state()) for c in cls}
        for c in cls:
            c.close()
    finally:
        server.stop()
    return seen, states


def test_two_replicas_give_every_rank_what_one_service_gives_it_also_across_a_replica_restart(tmp_path, registry):
    n, k = 8, 3
    one = load_config(None, overrides(tmp_path, f"run.name={registry.run}"))
    reference, reference_states = single_service_steps(one, n)
    cfg = load_config(None, overrides(tmp_path, f"run.name={registry.run}", "data.replicas=2"))
    servers = [DataLoaderServer(cfg, registry).start() for _ in range(2)]
    try:
        assert sorted(s.replica for s in servers) == [0, 1]  # claimed in the registry, one index each
        assert sorted((r["replica"], r["replicas"]) for r in registry.lookup("dataloader")) == [(0, 2), (1, 2)]
        cls = clients(registry, cfg, dp_size=DP, tp=1)
        by_replica = {s.replica: s for s in servers}
        for c in cls:  # dp ranks 0, 2 on replica 0; 1, 3 on replica 1
            assert c.grpc_endpoint == by_replica[c.dp_rank % 2].grpc_endpoint
        seen = [[] for _ in cls]
        finish(cls, seen, k)
        one_replica = by_replica[1]
        one_replica.stop()  # its ranks find the replacement (which claims the freed index 1) and resume it
        servers[servers.index(one_replica)] = replacement = DataLoaderServer(cfg, registry).start()
        assert replacement.replica == 1
        finish(cls, seen, n)
        assert_same_steps(seen, reference)
        assert [c.reconnects for c in cls] == [0, 1, 0, 1]
        assert {json.dumps(c.state()) for c in cls} == reference_states  # the checkpointed position is the same too
        for s in servers:
            assert s.engine.expected_clients() == 2  # each counts only its own ranks before dropping a step
        for c in cls:
            c.close()
    finally:
        for s in servers:
            s.stop()


def test_dynamic_cp_sizing_and_balancing_are_the_same_on_every_replica(tmp_path):
    cfg = dynamic_cp_cfg(tmp_path)
    datasets = open_all(cfg)
    full = StepStream(datasets, cfg.data, dp_size=DP, cp_sizes=cfg.parallel.cp_sizes)
    replicas = [StepStream(datasets, cfg.data, dp_size=DP, cp_sizes=cfg.parallel.cp_sizes) for _ in range(2)]
    for r, stream in enumerate(replicas):
        stream.dp_ranks = {d for d in range(DP) if d % 2 == r}
    sizes = set()
    for _ in range(6):
        want = full.next_step()
        sizes |= {mb.cp_size for rank in want.per_rank for mb in rank}
        got = [stream.next_step() for stream in replicas]
        assert all(g.state_after == want.state_after for g in got)
        for dp_rank in range(DP):
            mine, other = got[dp_rank % 2].per_rank[dp_rank], got[1 - dp_rank % 2].per_rank[dp_rank]
            assert other == []  # the replica that does not serve a rank builds nothing for it
            assert [mb.cp_size for mb in mine] == [mb.cp_size for mb in want.per_rank[dp_rank]]
            assert all(same(a.tensors, b.tensors) for a, b in zip(mine, want.per_rank[dp_rank], strict=True))
    assert len(sizes) > 1  # the steps did go through dynamic sizing and balancing


def test_a_replica_refuses_a_rank_it_does_not_serve_and_names_the_right_one(tmp_path):
    cfg = load_config(None, overrides(tmp_path, "data.replicas=2"))
    server = DataLoaderServer(cfg, replica=0).start()
    try:
        wrong = DataClient(server.zmq_endpoint, server.grpc_endpoint, dp_rank=1, dp_size=2, grad_accum=2, rank=1,
                           timeout=5)
        with pytest.raises(DataError, match=r"dp_rank 1\) is not served by this dataloader: replica 0 of "
                                            r"data.replicas=2.*connect to replica 1"):
            wrong.next_step()
        wrong.close()
        right = DataClient(server.zmq_endpoint, server.grpc_endpoint, dp_rank=0, dp_size=2, grad_accum=2, rank=0,
                           timeout=5)
        assert len(right.next_step()) == 2  # the refusal left the replica serving
        right.close()
    finally:
        server.stop()


def test_replicas_must_be_positive():
    with pytest.raises(ConfigError, match="data.replicas"):
        load_config(None, ["data.replicas=0"])
