"""Saves asked for while a run trains (the checkpointer's gRPC `Save`): one step that every trainer rank agrees on,
agreed through Redis alone, with no collective in the training step.

A rank decides at each step boundary whether that step saves, and the ranks' hosts run steps apart (each queues work
ahead of its device). So an asked-for save must name a step no rank has decided about yet and every rank will:
- before deciding about step t, each rank records t and reads the asked-for steps, in one atomic script (`decide`);
- `ask` takes the furthest step any rank has recorded (or the step the run started from), adds one, and adds it to
  the asked-for steps, atomically too. Every rank is at or behind the furthest, so each will record that step next
  or later, and none has read the asked set at it yet.
Keys carry the trainer session (services/trainer/checkpointing.py `connect`): a restarted trainer never acts on a
crashed one's requests, and `ask` reads the newest session's progress. The scripts build the session's key names
from a prefix, which a single Redis (the project's control plane) allows and Redis Cluster would not.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from services.common.registry import Registry

KEY_TTL_S = 7 * 24 * 3600  # a session's keys outlive any pause an operator leaves between a run's steps

# KEYS: progress hash, asked set. ARGV: rank, step, ttl. Returns 1 when `step` was asked for.
_DECIDE = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return redis.call('SISMEMBER', KEYS[2], ARGV[2])
"""

# KEYS: the trainer hash. ARGV: the session keys' prefix, ttl.
# Returns {step} when asked, {0} with no trainer session, {-1, last} when every rank is past the run's last step.
_ASK = """
local session = redis.call('HGET', KEYS[1], 'session')
if not session then return {0} end
local step = tonumber(redis.call('HGET', KEYS[1], 'start'))
for _, v in ipairs(redis.call('HVALS', ARGV[1] .. 'progress:' .. session)) do step = math.max(step, tonumber(v)) end
step = step + 1
local last = tonumber(redis.call('HGET', KEYS[1], 'last'))
if step > last then return {-1, last} end
local asked = ARGV[1] .. 'asked:' .. session
redis.call('SADD', asked, step)
redis.call('EXPIRE', asked, ARGV[2])
return {step}
"""


class SaveRequestError(RuntimeError):
    """A save that cannot be asked for now (no trainer running, the run has ended); the message says which."""


@dataclass(frozen=True)
class Asked:
    step: int          # the step whose state the save holds
    last: bool = False  # every rank had passed its last decision: `step` is the run's last step, saved anyway


def _prefix(registry: Registry) -> str:
    return f"foldmoe:{registry.run}:save:"


class SaveRequests:
    """A trainer rank's side: announce the session once, then `decide(step)` at every step boundary."""

    def __init__(self, registry: Registry, session: str, rank: int, start_step: int, last_step: int):
        self.client, self.rank = registry.client, rank
        prefix = _prefix(registry)
        self._keys = [prefix + f"progress:{session}", prefix + f"asked:{session}"]
        # every rank writes the same fields, so whichever rank is first announces the session before it records
        registry.client.hset(prefix + "trainer", mapping={"session": session, "start": start_step, "last": last_step})
        self._decide = registry.client.register_script(_DECIDE)

    def decide(self, step: int) -> bool:
        """Records that this rank is deciding about `step`; True when a save of `step` was asked for."""
        return bool(self._decide(keys=self._keys, args=[self.rank, step, KEY_TTL_S]))


def ask(registry: Registry) -> Asked:
    """Asks the running trainer for a save at the next step none of its ranks has decided about (SaveRequestError when
    no trainer is registered). The caller learns that step; the save commits once the ranks get there."""
    if not registry.lookup("trainer"):
        raise SaveRequestError(f"no trainer of run {registry.run!r} is registered: nothing to save")
    prefix = _prefix(registry)
    try:
        reply = registry.client.register_script(_ASK)(keys=[prefix + "trainer"], args=[prefix, KEY_TTL_S])
    except redis.RedisError as e:
        raise SaveRequestError(f"cannot ask for a save through Redis {registry.url}: {e}") from e
    if reply[0] == 0:
        raise SaveRequestError(f"the trainer of run {registry.run!r} has not announced its session yet; ask again "
                               "once it has started")
    if reply[0] == -1:
        return Asked(step=int(reply[1]), last=True)
    return Asked(step=int(reply[0]))
