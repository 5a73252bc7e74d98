"""The commit barrier (services/checkpointer/barrier.py) when a writer replica dies mid-save.

Specification: exactly one registered replica claims a save once every rank is on disk; a replica killed after
claiming (while committing, before publishing) does not block its replacement, which the trainer re-sends the save to;
ranks recorded by a dead replica do not count toward `world_size` (its replacement deleted their staged files); a live
replica's claim stands. "Dead" is "no longer registered": its heartbeat lapsed or stopped.
"""

from __future__ import annotations

import uuid

import pytest
import redis

from services.checkpointer.barrier import Barrier
from services.common.registry import Registry

REDIS = "redis://127.0.0.1:6379"


@pytest.fixture
def registry():
    try:
        redis.Redis.from_url(REDIS).ping()
    except redis.RedisError:
        pytest.fail(f"these tests need a Redis server at {REDIS} (.ci/run starts one)")
    reg = Registry(REDIS, f"test-barrier-{uuid.uuid4().hex[:8]}")
    yield reg
    for key in reg.client.scan_iter(match=f"foldmoe:{reg.run}:*"):
        reg.client.delete(key)


def replica(registry: Registry, name: str):
    """A registered writer replica: (its barrier, its heartbeat; stop the heartbeat to kill it)."""
    return Barrier(registry, name), registry.register("checkpointer", {"zmq": f"tcp://{name}"}, instance=name)


def test_a_claim_left_by_a_writer_killed_while_committing_is_taken_over_by_its_replacement(registry):
    old, old_beat = replica(registry, "writer-a")
    assert old.arrive("", 8, "s1", rank=0, world_size=1)  # claimed; killed before publishing the outcome
    old_beat.stop()
    new, new_beat = replica(registry, "writer-b")
    assert new.arrive("", 8, "s1", rank=0, world_size=1), "the replacement must commit the re-sent save"
    new_beat.stop()


def test_a_live_replicas_claim_stands(registry):
    a, a_beat = replica(registry, "writer-a")
    b, b_beat = replica(registry, "writer-b")
    assert a.arrive("", 3, "s1", rank=0, world_size=2) is False
    assert b.arrive("", 3, "s1", rank=1, world_size=2) is True  # the last arrival claims
    assert a.arrive("", 3, "s1", rank=0, world_size=2) is False  # a again (a retry): b holds the claim and lives
    a_beat.stop(), b_beat.stop()


def test_ranks_recorded_by_a_dead_replica_do_not_count(registry):
    old, old_beat = replica(registry, "writer-a")
    assert old.arrive("", 5, "s1", rank=1, world_size=2) is False
    old_beat.stop()
    new, new_beat = replica(registry, "writer-b")
    # rank 1's files went with the old replica's staging directory: committing now would miss them
    assert new.arrive("", 5, "s1", rank=0, world_size=2) is False
    assert new.arrive("", 5, "s1", rank=1, world_size=2) is True  # once the re-sent rank 1 is on disk here too
    new_beat.stop()
