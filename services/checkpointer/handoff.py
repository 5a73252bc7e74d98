"""Trainer side of a checkpoint, second half: hand a save's host buffers to a writer and wait for its commit.

`snapshot.Snapshotter` copies a rank's state into host buffers; its sender thread then gives each save to
`WriterLink.deliver`, which returns only once the save is committed (or has finally failed).

Handoff: a writer on the same host that proves it sees our shared-memory directory (its `shm_probe`) reads the
snapshot file directly (the ZMQ message carries only the header); any other writer receives the bytes as ZMQ frames.

Writer restarts: a save's host buffer is held until the save is committed or has finally failed. While the link waits
for the answer it checks the registry every `RECHECK_S`; when its writer's record is gone (the launcher removes a
crashed service's record, or its heartbeat lapses) or names another pid/endpoint, it waits for a writer to be
registered again (at most `timeout_s`, logging the step and the wait) and sends the whole save again. Every rank does
the same, with the same session, step and part numbering, so the new writer (which starts with no half-received
saves) assembles and commits the step. A save issued while no writer is registered waits the same way. The same
writer process (same instance, pid and endpoint) is never sent a save twice; a writer that answers with an error fails
the save.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis
import zmq

from proto import checkpointer_pb2 as pb
from services.checkpointer.shm import shares_memory_with
from services.common import logs, wire
from services.common.host_memory import HostArena
from services.common.registry import Registry

log = logs.logger("checkpointer")

SERVICE = "checkpointer"
RECHECK_S = 1.0  # while a save awaits its answer, how often the registry is asked whether its writer still runs
RESOLVE_POLL_S = 0.2  # while no writer is registered, how often the registry is asked again


class SaveError(RuntimeError):
    """The writer could not commit a save (or could not be reached); the message says which and why.

    `unanswered`: no writer answered, so one may still be reading the save's host buffers (they must not be reused)."""

    def __init__(self, message: str, unanswered: bool = False):
        super().__init__(message)
        self.unanswered = unanswered


@dataclass
class Parcel:
    """One rank's save as a writer receives it: the host buffers and how they are cut into parts (one file each)."""
    step: int
    arena: HostArena
    parts: list[list[pb.TensorRecord]]
    extra: bytes  # JSON, sent with part 0


def pick_writer(records: list[dict[str, Any]], host: str, rank: int) -> dict[str, Any]:
    """The writer replica for this rank: one on the same host when there is one (spread by rank), else any."""
    same_host = sorted((r for r in records if r.get("host") == host), key=lambda r: r["instance"])
    pool = same_host or sorted(records, key=lambda r: r["instance"])
    return pool[rank % len(pool)]


class WriterLink:
    """One rank's connection to the checkpoint writer: a fixed `endpoint`, or the writer `registry` names for `host`.
    Used by one thread (the snapshotter's sender)."""

    def __init__(self, endpoint: str | None, registry: Registry | None, *, rank: int, world_size: int, run: str,
                 session: str, host: str, token: str, timeout_s: float):
        self.endpoint, self.registry = endpoint, registry
        self.rank, self.world_size, self.run, self.session = rank, world_size, run, session
        self.host, self.token, self.timeout_s = host, token, timeout_s
        self._sock: zmq.Socket | None = None  # a DEALER, connected to `_connected`
        self._connected = ""
        self._redis_warned = -1e9  # when a failed registry lookup was last logged
        self.last_shared = False  # the latest sent save went through shared memory (else ZMQ frames)

    def deliver(self, parcel: Parcel) -> str:
        """Send `parcel` and return the committed path. When its writer disappears before answering (killed and
        restarted: its registration is gone, or names another process or endpoint) the whole parcel is sent again,
        from the same host buffers, to the writer registered next: the new writer assembles the step from every rank's
        re-sent parts (same session, step and part numbering; a restarted writer starts with no half-received save
        and clears the old staging directory). The same, still-alive writer is never sent a parcel twice. A writer that
        answers with an error fails the save; so does a wait beyond `timeout_s` (for a writer, or for an answer)."""
        ctx = zmq.Context.instance()
        baseline = None
        if self.registry is not None:
            try:
                baseline = self.registry.get_state("checkpoint/latest")
            except redis.RedisError:
                pass
        record = self._resolve(parcel)
        assert isinstance(record, dict)
        send, sends, deadline = True, 0, 0.0
        while True:
            endpoint = record["zmq"]
            if send:
                sock = self._connect(ctx, endpoint)
                shared = parcel.arena.shared and shares_memory_with(record)
                if sends:
                    log.warning("rank %d: re-sending the whole checkpoint of step %d to checkpointer %s (send %d)",
                                self.rank, parcel.step, _describe(record), sends + 1)
                self._send(sock, parcel, shared)
                sends += 1
                deadline = time.monotonic() + self.timeout_s
            path = self._await(sock, parcel, endpoint, record, deadline, baseline if sends > 1 else _NO_BASELINE)
            if path is not None:
                return path
            # The writer left the registry without answering: wait for a writer to be registered again (still
            # listening to this socket, in case the writer was alive after all and answers).
            gone = (f"checkpointer {_describe(record)} vanished from the registry before answering for step "
                    f"{parcel.step}")
            log.warning("rank %d: %s; waiting up to %.0fs for a checkpointer to register, then re-sending the save",
                        self.rank, gone, self.timeout_s)
            try:
                found = self._resolve(parcel, why=gone + "; ", sock=sock)
            except SaveError as e:  # the vanished writer may still be reading our buffers
                raise SaveError(f"rank {self.rank}: no answer from the checkpoint writer at {endpoint} for step "
                                f"{parcel.step}, and {str(e).removeprefix(f'rank {self.rank}: ')}",
                                unanswered=True) from None
            if isinstance(found, str):
                return found
            if (path := self._committed_meanwhile(parcel, baseline)) is not None:
                log.warning("rank %d: step %d was committed (%s) before its writer died; not re-sending it",
                            self.rank, parcel.step, path)
                return path
            if _identity(found) == _identity(record):
                # The same process registered again (its record had lapsed): it has the parts; keep waiting for it.
                log.warning("rank %d: checkpointer %s is registered again; still waiting for its answer for step %d",
                            self.rank, _describe(record), parcel.step)
                send = False
                continue
            self.disconnect()  # parts still queued for the dead writer are dropped; the new one gets the whole parcel
            record, send = found, True

    def disconnect(self) -> None:
        """Drop queued parts and any late answer: the next send starts clean."""
        if self._sock is not None:
            self._sock.close(linger=0)
        self._sock, self._connected = None, ""

    def _lookup(self) -> list[dict[str, Any]] | None:
        """The registered writers; None when Redis cannot be asked right now (it may be restarting)."""
        try:
            return self.registry.lookup(SERVICE)
        except redis.RedisError as e:
            if time.monotonic() - self._redis_warned > 10.0:
                self._redis_warned = time.monotonic()
                log.warning("rank %d: cannot look up the checkpointer in Redis (%s); retrying", self.rank, e)
            return None

    def _resolve(self, parcel: Parcel, why: str = "", sock: zmq.Socket | None = None) -> dict[str, Any] | str:
        """The writer to send `parcel` to. While none is registered, wait for one (at most `timeout_s`, with a warning
        naming the step); meanwhile `sock` (the socket of a writer that vanished from the registry) is still polled:
        returns the committed path instead if that writer answers after all."""
        if self.registry is None:
            return {"zmq": self.endpoint}
        deadline = time.monotonic() + self.timeout_s
        warned = False
        while True:
            records = self._lookup()
            if records:
                record = pick_writer(records, self.host, self.rank)
                if warned:
                    log.warning("rank %d: checkpointer %s is registered; sending the checkpoint of step %d to it",
                                self.rank, _describe(record), parcel.step)
                return record
            if not warned:
                if not why:  # (after a writer vanished, `deliver` has said so already)
                    log.warning("rank %d: no checkpointer is registered for run %r; the checkpoint of step %d waits "
                                "up to %.0fs for one to register (the launcher restarts a crashed one)", self.rank,
                                self.registry.run, parcel.step, self.timeout_s)
                warned = True
            if time.monotonic() >= deadline:
                raise SaveError(f"rank {self.rank}: {why}no checkpointer registered for run {self.registry.run!r} at "
                                f"{self.registry.url} within {self.timeout_s:.0f}s, so the checkpoint of step "
                                f"{parcel.step} was not saved; start `python -m services.checkpointer.writer --config "
                                "FILE`")
            if sock is None:
                time.sleep(RESOLVE_POLL_S)
            elif (path := self._answer(sock, parcel, RESOLVE_POLL_S)) is not None:
                return path

    def _writer_gone(self, record: dict[str, Any]) -> bool | None:
        """True when `record`'s writer is no longer registered (its record expired or was removed by the launcher) or
        its registration now names another process/endpoint; None when Redis cannot tell."""
        records = self._lookup()
        if records is None:
            return None
        now = next((r for r in records if r.get("instance") == record.get("instance")), None)
        return now is None or _identity(now) != _identity(record)

    def _committed_meanwhile(self, parcel: Parcel, baseline: Any) -> str | None:
        """The path of `parcel`'s step when a writer committed it and published it as the latest checkpoint after the
        parcel was first sent: a writer that committed and answered some ranks but died before answering this one."""
        try:
            latest = self.registry.get_state("checkpoint/latest")
        except redis.RedisError:
            return None
        if isinstance(latest, dict) and latest.get("step") == parcel.step and latest != baseline:
            return str(latest.get("path", ""))
        return None

    def _connect(self, ctx: zmq.Context, endpoint: str) -> zmq.Socket:
        if self._sock is None or endpoint != self._connected:
            self.disconnect()
            self._sock = ctx.socket(zmq.DEALER)
            self._sock.connect(endpoint)
            self._connected = endpoint
        return self._sock

    def _send(self, sock: zmq.Socket, parcel: Parcel, shared: bool) -> None:
        self.last_shared = shared
        for i, records in enumerate(parcel.parts):
            header = pb.ShardHeader(run=self.run, step=parcel.step, rank=self.rank, world_size=self.world_size, part=i,
                                    num_parts=len(parcel.parts), tensors=records, session=self.session,
                                    extra=parcel.extra if i == 0 else b"",
                                    shm_path=str(parcel.arena.path) if shared else "")
            # services.common.wire cannot frame 0-d tensors (a byte view needs a dimension): send them as [1]; the
            # writer restores the shape from the record.
            tensors = {} if shared else {r.name: parcel.arena.views[r.name].reshape(-1) if not r.shape
                                         else parcel.arena.views[r.name] for r in records}
            wire.send(sock, "ckpt.shard", header, tensors, token=self.token)

    def _answer(self, sock: zmq.Socket, parcel: Parcel, wait_s: float) -> str | None:
        """The committed path if the writer's answer for `parcel` arrives within `wait_s`; SaveError if it failed it."""
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(max(1, int(left * 1000))):
                return None
            kind, result, _ = wire.recv(sock, pb.SaveResult)
            if result.step != parcel.step:
                continue  # a late answer to a save we already gave up on
            if kind == "ckpt.committed":
                return result.path
            raise SaveError(f"rank {self.rank}: {result.error or kind}")
        return None

    def _await(self, sock: zmq.Socket, parcel: Parcel, endpoint: str, record: dict[str, Any], deadline: float,
               baseline: Any) -> str | None:
        """The committed path; None when the writer left the registry before answering (see `_writer_gone`)."""
        while (left := deadline - time.monotonic()) > 0:
            if (path := self._answer(sock, parcel, min(left, RECHECK_S))) is not None:
                return path
            if self.registry is None or time.monotonic() >= deadline:
                continue
            if self._writer_gone(record):
                return None
            if baseline is not _NO_BASELINE and (path := self._committed_meanwhile(parcel, baseline)) is not None:
                return path
        raise SaveError(f"rank {self.rank}: no answer from the checkpoint writer at {endpoint} within "
                        f"{self.timeout_s:.0f}s for step {parcel.step}; is it running (and is the disk responsive)?",
                        unanswered=True)


_NO_BASELINE = object()


def _identity(record: dict[str, Any]) -> tuple:
    """What tells one writer process from its replacement: a restart registers another pid and endpoint."""
    return record.get("instance"), record.get("pid"), record.get("zmq")


def _describe(record: dict[str, Any]) -> str:
    return f"{record.get('instance', '?')} (pid {record.get('pid', '?')}, {record.get('zmq')})"
