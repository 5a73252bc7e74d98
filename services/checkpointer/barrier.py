"""Which writer replica commits a save, when ranks' parts are spread over several replicas (one per host).

Every replica records in Redis each rank it has fully written; the replica that sees all `world_size` ranks recorded
claims the commit (SET NX, so exactly one wins) and publishes the outcome, which the other replicas poll to answer
their own ranks. Keys carry the trainer session so a restarted trainer never completes a crashed one's save, and
expire so an abandoned save leaves nothing behind. With one replica the same protocol simply always elects it.

A failed save may be retried under the same step and session; its stale outcome is told apart by time, read from the
Redis server's clock only (one clock, so "published before this attempt began" is exact across hosts).

A replica killed mid-save leaves its arrivals and, if it got that far, its claim behind: killed while committing, it
holds the claim of a save it will never publish, and the trainer re-sends the whole save to its replacement. So only
replicas registered now count: their arrivals toward `world_size`, and their claims; a claim whose holder is gone is
taken over. A killed replica's registry record outlives it until its heartbeat lapses, and a re-sent part can reach
the replacement inside that window, so the replacement also deletes the interrupted step's arrivals before it
registers (writer.forget_stale_arrivals).
"""

from __future__ import annotations

import json

import redis

from services.common.registry import Registry

KEY_TTL_S = 3600


class Barrier:
    def __init__(self, registry: Registry, instance: str, ttl_s: int = KEY_TTL_S, service: str = "checkpointer"):
        self.registry, self.client, self.run = registry, registry.client, registry.run
        self.instance, self.ttl_s, self.service = instance, ttl_s, service

    def _key(self, run: str, step: int, session: str, what: str) -> str:
        return f"foldmoe:{run or self.run}:ckpt:{step}:{session or '-'}:{what}"

    def arrive(self, run: str, step: int, session: str, rank: int, world_size: int) -> bool:
        """Record that `rank` is on disk; True when this replica must now commit the save."""
        ranks = self._key(run, step, session, "ranks")
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(ranks, str(rank), self.instance)
        pipe.expire(ranks, self.ttl_s)
        pipe.hgetall(ranks)
        arrived = pipe.execute()[-1]  # rank -> the replica that wrote it
        live = self._live()
        if sum(holder in live for holder in arrived.values()) < world_size:
            return False
        return self._claim(self._key(run, step, session, "claim"), live)

    def _live(self) -> set[str]:
        """The replicas registered now, and this one (registered or not: a test's writer may not be)."""
        return {r.get("instance") for r in self.registry.lookup(self.service)} | {self.instance}

    def _claim(self, key: str, live: set[str]) -> bool:
        """SET NX; a claim held by a replica no longer registered is taken over (WATCH: one taker wins)."""
        if self.client.set(key, self.instance, nx=True, ex=self.ttl_s):
            return True
        with self.client.pipeline() as pipe:
            try:
                pipe.watch(key)
                holder = pipe.get(key)
                if holder in live:
                    return holder == self.instance
                pipe.multi()
                pipe.set(key, self.instance, ex=self.ttl_s)
                pipe.execute()
                return True
            except redis.WatchError:  # another replica took it (or published) meanwhile
                return False

    def now(self) -> float:
        seconds, micros = self.client.time()
        return seconds + micros / 1e6

    def publish(self, run: str, step: int, session: str, since: float, path: str, error: str) -> None:
        """Record the outcome of the attempt that began at `since`; within an attempt the first outcome wins (a late
        failure cannot undo a commit), an earlier attempt's outcome is replaced."""
        key = self._key(run, step, session, "outcome")
        value = json.dumps({"path": path, "error": error, "time": self.now()})
        previous = self.client.get(key)
        if previous is None or json.loads(previous)["time"] < since:
            self.client.set(key, value, ex=self.ttl_s)
        self.client.delete(self._key(run, step, session, "ranks"), self._key(run, step, session, "claim"))

    def outcome(self, run: str, step: int, session: str, since: float) -> tuple[str, str] | None:
        """(path, error) of the attempt that began at `since` (Redis clock), None while it is undecided."""
        raw = self.client.get(self._key(run, step, session, "outcome"))
        if raw is None:
            return None
        value = json.loads(raw)
        if value["time"] < since:
            return None  # an earlier attempt's verdict
        return value["path"], value["error"]
