"""The trainer's side of the rollout stream: it takes only groups fresh enough for its weights (neither older than the
staleness bound nor from a version it has not reached, which only an earlier trainer incarnation can have made),
deletes what it reads, discards a previous incarnation's backlog, and checkpoints its counters, not a position."""

from __future__ import annotations

import os
import uuid

import pytest
import redis

from proto import rollout_pb2 as pb
from services.trainer.rl.rollouts import RolloutReader

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def group(gid: str, version: int) -> bytes:
    g = pb.TrajectoryGroup(group_id=gid, worker="w", policy_version=version, prompt_tokens=[1, 2], moe_layers=1,
                           top_k=1, temperature=1.0)
    for reward in (0.0, 1.0):
        g.samples.add(tokens=[3, 4], logprobs=[-0.5, -0.25], routing=[0, 1, 0], reward=reward)
    return g.SerializeToString()


@pytest.fixture
def stream():
    key = f"test-rl-reader-{uuid.uuid4().hex[:10]}"
    client = redis.Redis.from_url(REDIS_URL)
    yield key, client
    client.delete(key)


def test_only_groups_within_the_staleness_bound_and_not_from_the_future_are_used(stream):
    key, client = stream
    for gid, version in (("old", 1), ("ok-2", 2), ("future", 4), ("ok-3", 3)):
        client.xadd(key, {"group": group(gid, version)})
    reader = RolloutReader(REDIS_URL, key, max_staleness=1)
    got = reader.next_groups(2, trainer_version=3, timeout_s=5)
    assert [g.group_id for g in got] == ["ok-2", "ok-3"]
    assert (reader.dropped_stale, reader.dropped_foreign) == (1, 1)
    assert client.xlen(key) == 0  # read means deleted: the stream length is the workers' backlog
    with pytest.raises(TimeoutError, match="are rollout workers running"):
        reader.next_groups(1, trainer_version=3, timeout_s=0.3)
    reader.close()


def test_a_new_trainer_discards_the_backlog_of_the_previous_one(stream):
    key, client = stream
    for i in range(3):
        client.xadd(key, {"group": group(f"g{i}", 0)})
    reader = RolloutReader(REDIS_URL, key, max_staleness=1)
    assert reader.discard_backlog() == 3 and client.xlen(key) == 0
    client.xadd(key, {"group": group("fresh", 0)})
    assert [g.group_id for g in reader.next_groups(1, 0, timeout_s=5)] == ["fresh"]
    reader.close()


def test_the_checkpointed_data_state_restores_the_counters_and_refuses_a_corpus_state(stream):
    key, _ = stream
    reader = RolloutReader(REDIS_URL, key, max_staleness=1)
    reader.dropped_stale, reader.dropped_foreign = 5, 2
    state = reader.state()
    again = RolloutReader(REDIS_URL, key, max_staleness=1)
    again.resume(state)
    assert (again.dropped_stale, again.dropped_foreign) == (5, 2)
    with pytest.raises(ValueError, match="not an RL run's rollout stream"):
        again.resume({"step": 3, "source": {"position": 10}})
    reader.close()
    again.close()
