"""Redis control plane: service registry with heartbeats, and small run state.

Keys are namespaced by run: `foldmoe:{run}:svc:{service}:{instance}` holds a JSON record that expires unless its
heartbeat refreshes it, so a dead service disappears from `lookup` within `ttl` seconds.

A command that finds Redis gone (connection refused or reset: a restart, e.g. the launcher replacing a crashed embedded
Redis, which comes back with its data) is retried with back-off for about half a minute before its error is raised.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

DEFAULT_TTL_S = 10.0
# A command that cannot reach Redis is retried after 0.1, 0.2, 0.4, 0.8 s, then every second: 27.5 s of back-off
RECONNECT_RETRIES = 30
SCAN_COUNT = 1000  # keys Redis visits per SCAN round trip (its default, 10, costs a round trip per 10 keys)


class RegistryError(RuntimeError):
    """Redis is unreachable or a service did not appear in time."""


def redis_url() -> str:
    url = os.environ.get("REDIS_URL", "")
    if not url:
        raise RegistryError("REDIS_URL is not set: start services through `foldmoe train`, or export REDIS_URL=redis://host:port")
    return url


def connect(url: str, decode_responses: bool = True) -> redis.Redis:
    """A client of the Redis at `url` that rides out a restart (module docstring); an unreachable one fails at once."""
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=10, retry=Retry(NoBackoff(), 0)) as p:
            p.ping()
    except (redis.RedisError, ValueError) as e:
        raise RegistryError(f"cannot reach Redis at {url} ({e}); start it, or leave run.redis_url empty so "
                            "the launcher starts an embedded one") from None
    return redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=10, decode_responses=decode_responses,
                                retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), RECONNECT_RETRIES),
                                retry_on_error=[redis.ConnectionError])


class Heartbeat:
    """Keeps one registration alive until `stop()`."""

    def __init__(self, client: redis.Redis, key: str, record: dict[str, Any], ttl: float):
        self._client, self._key, self._ttl = client, key, ttl
        self._payload = json.dumps(record)
        self._stop = threading.Event()
        # A beat reads the record and writes it under the lock, so an update's write (the record changed first) is
        # never followed by a beat's write of the record before it (the workers' reservations ride on updates), nor
        # `stop`'s delete by a beat
        self._lock = threading.Lock()
        self._beat()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat:{key}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        with self._lock:
            if not self._stop.is_set():  # a beat after `stop` would bring the record back for a TTL
                self._client.set(self._key, self._payload, px=int(self._ttl * 1000))

    def _run(self) -> None:
        while not self._stop.wait(self._ttl / 3):
            try:
                self._beat()
            except redis.RedisError:
                pass  # Redis restarting: the next beat re-registers

    def update(self, **fields: Any) -> None:
        """Add or change fields of the record (e.g. an id known only once `Registry.claim` chose the slot)."""
        record = json.loads(self._payload)
        record.update(fields)
        self._payload = json.dumps(record)
        self._beat()

    def stop(self) -> None:
        self._stop.set()
        try:
            with self._lock:  # after a beat in progress
                self._client.delete(self._key)
        except redis.RedisError:
            pass


def _record(service: str, instance: str, info: dict[str, Any]) -> dict[str, Any]:
    """A registration: who, where, since when, and the service's own fields."""
    return {"service": service, "instance": instance, "host": socket.gethostname(), "pid": os.getpid(),
            "started": time.time(), **info}


class Registry:
    def __init__(self, url: str, run: str):
        self.url, self.run = url, run
        self.client = connect(url)

    def _key(self, *parts: str) -> str:
        return ":".join(("foldmoe", self.run, *parts))

    def register(self, service: str, info: dict[str, Any], instance: str | None = None,
                 ttl: float = DEFAULT_TTL_S) -> Heartbeat:
        instance = instance or f"{socket.gethostname()}-{os.getpid()}"
        return Heartbeat(self.client, self._key("svc", service, instance), _record(service, instance, info), ttl)

    def claim(self, service: str, slots: int, info: dict[str, Any], timeout: float = 3 * DEFAULT_TTL_S,
              ttl: float = DEFAULT_TTL_S) -> tuple[int, Heartbeat]:
        """Register as the lowest free one of `slots` numbered instances of `service` (instance "replica<i>", record
        fields "replica" and "replicas"); returns (i, heartbeat). Atomic (SET NX): two processes never hold one slot.
        A slot frees when its holder stops, or its record expires (a killed holder: within `ttl`)."""
        deadline = time.monotonic() + timeout
        while True:
            for i in range(slots):
                instance = f"replica{i}"
                record = _record(service, instance, {**info, "replica": i, "replicas": slots})
                key, payload = self._key("svc", service, instance), json.dumps(record)
                # the second test: our own SET, applied by a Redis that died before its reply, then retried
                if self.client.set(key, payload, px=int(ttl * 1000), nx=True) or self.client.get(key) == payload:
                    return i, Heartbeat(self.client, key, record, ttl)
            if time.monotonic() > deadline:
                raise RegistryError(f"all {slots} {service} replicas of run {self.run!r} are taken (Redis {self.url}); "
                                    f"stop one, or raise the replica count")
            time.sleep(0.2)

    def take_turn(self, job: str, holder: str, ttl: float = 86400.0) -> bool:
        """True for the first caller, among every process of the run, to take `job` (within `ttl` seconds): one of
        several services does a job once. Atomic (SET NX)."""
        return bool(self.client.set(self._key("turn", job), holder, ex=max(1, int(ttl)), nx=True))

    def _records(self, pattern: str) -> list[dict[str, Any]]:
        """The live records whose keys match `pattern`, in key order: a SCAN of up to `SCAN_COUNT` keys a round trip
        and one MGET (workers poll this several times a second; a record that expired in between is skipped)."""
        keys = sorted(self.client.scan_iter(match=pattern, count=SCAN_COUNT))
        return [json.loads(r) for r in (self.client.mget(keys) if keys else []) if r]

    def lookup(self, service: str) -> list[dict[str, Any]]:
        return self._records(self._key("svc", service, "*"))

    def services(self) -> list[dict[str, Any]]:
        return self._records(self._key("svc", "*"))

    def wait_for(self, service: str, count: int = 1, timeout: float = 60.0,
                 where: Callable[[dict[str, Any]], bool] | None = None) -> list[dict[str, Any]]:
        """At least `count` records of `service` (those for which `where` holds, when given)."""
        deadline = time.monotonic() + timeout
        while True:
            found = [r for r in self.lookup(service) if where is None or where(r)]
            if len(found) >= count:
                return found
            if time.monotonic() > deadline:
                which = " matching" if where is not None else ""
                raise RegistryError(f"service {service!r} did not register within {timeout:.0f}s "
                                    f"(run {self.run!r}, Redis {self.url}; found {len(found)}{which} of {count})")
            time.sleep(0.1)

    def set_state(self, key: str, value: Any) -> None:
        self.client.set(self._key("state", key), json.dumps(value))

    def get_state(self, key: str, default: Any = None) -> Any:
        raw = self.client.get(self._key("state", key))
        return json.loads(raw) if raw is not None else default
