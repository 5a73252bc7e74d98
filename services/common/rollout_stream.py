"""The rollout stream's shared Redis convention, between its writers (rollout workers) and its reader (the dataloader).

The stream (one entry per trajectory group, field "group" = a `foldmoe.v1.TrajectoryGroup`) is read without deleting:
the dataloader keeps its entries until every trainer rank is a few steps past them, so that a restarted dataloader can
replay a step exactly. Its length is therefore not the backlog the workers throttle on. The reader records the id of
the last entry it has consumed under `read_position_key(stream)`; the backlog is the count of entries after it.
"""

from __future__ import annotations

import redis


def read_position_key(stream: str) -> str:
    return f"{stream}:read"


def mark_read(client: redis.Redis, stream: str, entry_id: str) -> None:
    """Record that every entry up to `entry_id` has been consumed."""
    client.set(read_position_key(stream), entry_id)


def unread(client: redis.Redis, stream: str, limit: int) -> int:
    """Entries after the read position, counted up to `limit` (the workers only ask whether the backlog is full)."""
    after = client.get(read_position_key(stream))
    start = f"({after.decode()}" if after else "-"
    return len(client.xrange(stream, min=start, max="+", count=max(1, limit)))
