"""Publishing a trajectory group is idempotent: a publish retried after a Redis that applied it died before replying
(the client retries; the restarted Redis has the entry from its append-only file) adds nothing the second time."""

from __future__ import annotations

import os
import uuid

from proto import rollout_pb2 as pb
from services.rl_rollout.publish import TrajectoryStream

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def test_a_publish_under_the_same_token_adds_nothing_and_answers_the_first_id():
    stream = TrajectoryStream(REDIS_URL, f"publish-{uuid.uuid4().hex[:8]}")
    try:
        group = pb.TrajectoryGroup(group_id="w0:0", policy_version=3)
        first = stream.publish(group, token="t")
        assert stream.publish(group, token="t") == first
        other = stream.publish(group)  # a new publish of equal bytes is a new group
        entries = stream.client.xrange(stream.key)
        assert [entry_id for entry_id, _ in entries] == [first, other]
        assert pb.TrajectoryGroup.FromString(entries[0][1][b"group"]) == group
        assert entries[0][1][b"version"] == b"3"
        stream.client.script_flush()  # a restarted Redis has no scripts: the client loads it again
        assert stream.publish(group, token="t") == first
    finally:
        stream.client.delete(stream.key, *stream.client.keys(f"{stream.key}:published:*"))
        stream.close()
