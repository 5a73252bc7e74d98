"""The rollout stream's shared Redis convention, between its writers (rollout workers) and its reader (the dataloader).

The stream (one entry per trajectory group, field "group" = a `foldmoe.v1.TrajectoryGroup`) is read without deleting:
the dataloader keeps its entries until every trainer rank is a few steps past them, so that a restarted dataloader can
replay a step exactly. Its length is therefore not the backlog the workers throttle on. The reader records the id of
the last entry it has consumed under `read_position_key(stream)` and the step it builds next under `step_key(stream)`;
from the versions of the entries after that position (`unread_versions`) a worker computes how many more groups of its
weights' version the steps will still read (`room`), as the dataloader reads them: step by step, in stream order,
dropping the groups too stale for the step. Stale groups therefore never hold the workers back (counting them would
stop the workers while the dataloader waits for fresh groups: the run would stall), and fresh ones beyond what the
steps that can use them will read do (they would only go stale). The groups other workers are generating count as
waiting too: a worker reserves what it takes of the room (`deciding`), so two workers deciding at once do not both
fill it.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import redis

# The run-state key (Registry.set_state) of the newest evaluation of the policy, which a rollout worker writes
# (services/rl_rollout/worker.py `evaluate_due`) and the trainer's RL records take (services/trainer/rl/train_rl.py).
EVAL_STATE = "rl_eval"


def read_position_key(stream: str) -> str:
    return f"{stream}:read"


def step_key(stream: str) -> str:
    return f"{stream}:step"


def prompt_cursor_key(stream: str) -> str:
    """The counter of `rl.prompts` places the workers have claimed (services/rl_rollout/prompts.py `RecordOrder`);
    a starting trainer sets it to where its checkpoint's data position left off."""
    return f"{stream}:prompts"


def prompt_again_key(stream: str) -> str:
    """The list of `rl.prompts` places to be asked again (claimed before the counter's next ones): those whose group
    was dropped (too stale to train) or lost (a worker died with it, the backlog a resume discards). The dataloader
    adds to it (`ask_again`), a starting trainer sets it (`set_prompt_places`)."""
    return f"{stream}:prompts:again"


def claim_places(client: redis.Redis, stream: str, count: int) -> tuple[list[int], list[int]]:
    """`count` places for a worker to ask, each claimed by it alone: (those to be asked again, oldest first; the
    counter's next ones)."""
    again = [int(p) for p in client.lpop(prompt_again_key(stream), count) or []]
    new = count - len(again)
    end = client.incrby(prompt_cursor_key(stream), new) if new else 0
    return again, list(range(end - new, end))


def ask_again(client: redis.Redis, stream: str, places: list[int], once_in_s: float) -> list[int]:
    """Queue `places` to be asked again, each at most once in `once_in_s` seconds however many dataloader replicas
    ask (the first to ask queues it), and only where the counter has passed it (it asks the others itself, as after
    a resume that set it back); returns those queued."""
    claimed = int(client.get(prompt_cursor_key(stream)) or 0)
    hold = max(1, int(once_in_s * 1000))
    queued = [p for p in places
              if p < claimed and client.set(f"{prompt_again_key(stream)}:{p}", 1, nx=True, px=hold)]
    if queued:
        client.rpush(prompt_again_key(stream), *queued)
    return queued


def withdraw_asks(client: redis.Redis, stream: str, places: list[int]) -> None:
    """`places` were answered after all (a late group of a place asked again): no worker need ask them now. What a
    worker claimed already is generated anyway, and dropped as a duplicate."""
    pipe = client.pipeline()
    for place in places:
        pipe.lrem(prompt_again_key(stream), 0, place)
    pipe.execute()


def set_prompt_places(client: redis.Redis, stream: str, next_place: int, missing: list[int]) -> None:
    """Where a starting trainer's workers ask from: the counter at `next_place` and the `missing` places below it (its
    data position's) to be asked first."""
    pipe = client.pipeline()
    pipe.set(prompt_cursor_key(stream), next_place)
    pipe.delete(prompt_again_key(stream))
    if missing:
        pipe.rpush(prompt_again_key(stream), *missing)
    pipe.execute()


def mark_read(client: redis.Redis, stream: str, entry_id: str, next_step: int | None = None) -> None:
    """Record that every entry up to `entry_id` has been consumed (and, if given, which step is built next)."""
    client.set(read_position_key(stream), entry_id)
    if next_step is not None:
        client.set(step_key(stream), next_step)


def unread_versions(client: redis.Redis, stream: str, fresh: int, max_staleness: int) -> tuple[list[int], int | None]:
    """The versions of the entries after the read position, in stream order, read until `fresh` of them are groups the
    next step could use (or the stream ends), and the step the dataloader builds next (None before its first; then
    every group counts as fresh). The stale ones come along: the steps drop them as they pass (`room`)."""
    after, step = client.mget(read_position_key(stream), step_key(stream))
    start = f"({after.decode()}" if after else "-"
    oldest = None if step is None else int(step) - max_staleness
    versions, counted = [], 0
    while counted < fresh:
        entries = client.xrange(stream, min=start, max="+", count=max(64, fresh - counted))
        if not entries:
            break
        for _, fields in entries:
            versions.append(_version(fields))
            counted += oldest is None or versions[-1] >= oldest
            if counted >= fresh:
                break
        start = f"({entries[-1][0].decode()}"
    return versions, None if step is None else int(step)


@contextmanager
def deciding(client: redis.Redis, stream: str, hold_ms: int = 2000) -> Iterator[None]:
    """Held by one worker at a time while it computes the room and reserves its share of it (the worker's registry
    record, field "reserved": [version, groups]), so that two workers never both take the room one batch fills. A
    holder that dies frees it after `hold_ms`."""
    key, token = f"{stream}:deciding", uuid.uuid4().hex
    while not client.set(key, token, nx=True, px=hold_ms):
        time.sleep(0.005)
    try:
        yield
    finally:
        if client.get(key) in (token, token.encode()):  # not one that took it after ours expired
            client.delete(key)


def room(waiting: list[int], next_step: int, version: int, max_staleness: int, groups_per_step: int) -> int:
    """How many groups of `version` made now the steps will still read, behind the `waiting` ones (their versions, in
    stream order). Step k reads, in stream order, the first `groups_per_step` groups of versions k - max_staleness
    .. k and drops the older ones it passes (services/dataloader/rollout_source.py), from `next_step` on; a group of
    `version` is read by step version + max_staleness at the latest, or never."""
    queue, free = deque(waiting), 0
    for k in range(next_step, version + max_staleness + 1):
        taken = 0
        while taken < groups_per_step and queue:
            taken += k - max_staleness <= queue.popleft() <= k
        free += groups_per_step - taken
    return free


def _version(fields: dict) -> int:
    if b"version" in fields:  # written next to the group by the workers (services/rl_rollout/publish.py)
        return int(fields[b"version"])
    from proto import rollout_pb2

    return rollout_pb2.TrajectoryGroup.FromString(fields[b"group"]).policy_version
