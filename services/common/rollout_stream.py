"""The rollout stream's shared Redis convention, between its writers (rollout workers) and its reader (the dataloader).

The stream (one entry per trajectory group, field "group" = a `foldmoe.v1.TrajectoryGroup`) is read without deleting:
the dataloader keeps its entries until every trainer rank is a few steps past them, so that a restarted dataloader can
replay a step exactly. Its length is therefore not the backlog the workers throttle on. The reader records the id of
the last entry it has consumed under `read_position_key(stream)` and the step it builds next under `step_key(stream)`;
the backlog is the count of entries after that position that the next step could still use: a group more than
`rl.max_staleness` versions older than that step will be dropped whatever happens. Counting those would let a backlog
of stale groups hold the workers back while the dataloader waits for fresh ones, and the run would stall.
"""

from __future__ import annotations

import redis


def read_position_key(stream: str) -> str:
    return f"{stream}:read"


def step_key(stream: str) -> str:
    return f"{stream}:step"


def mark_read(client: redis.Redis, stream: str, entry_id: str, next_step: int | None = None) -> None:
    """Record that every entry up to `entry_id` has been consumed (and, if given, which step is built next)."""
    client.set(read_position_key(stream), entry_id)
    if next_step is not None:
        client.set(step_key(stream), next_step)


def unread(client: redis.Redis, stream: str, limit: int, max_staleness: int | None = None) -> int:
    """Entries after the read position, counted up to `limit` (the workers only ask whether the backlog is full).
    With `max_staleness` (and a recorded next step), only the groups that step could use count (module docstring)."""
    after, step = client.mget(read_position_key(stream), step_key(stream))
    start = f"({after.decode()}" if after else "-"
    if max_staleness is None or step is None:
        return len(client.xrange(stream, min=start, max="+", count=max(1, limit)))
    oldest, counted = int(step) - max_staleness, 0
    while counted < limit:
        entries = client.xrange(stream, min=start, max="+", count=max(64, limit))
        if not entries:
            break
        counted += sum(1 for _, fields in entries if _version(fields) >= oldest)
        start = f"({entries[-1][0].decode()}"
    return min(counted, limit)


def _version(fields: dict) -> int:
    if b"version" in fields:  # written next to the group by the workers (services/rl_rollout/publish.py)
        return int(fields[b"version"])
    from proto import rollout_pb2

    return rollout_pb2.TrajectoryGroup.FromString(fields[b"group"]).policy_version
