"""The checkpoint writer service: receives every rank's shards over ZMQ, stages them, commits atomically, answers.

    python -m services.checkpointer.writer --config FILE [checkpoint.dir=... checkpoint.keep_last=...]

Each rank's DEALER sends `ckpt.shard` parts (see proto/checkpointer.proto). Each part becomes one file, written by a
pool of threads as parts arrive (hashing while writing); a part either carries its tensors as ZMQ frames or, from a
rank on this host, names the rank's shared-memory snapshot file, which is read in place. When all of a rank's parts
are on disk its record is written; when all `world_size` ranks are recorded the save is committed
(store.CheckpointStore.commit) and every rank is answered `ckpt.committed` — or `ckpt.failed` with the reason.
Several replicas may share one directory (one per host); then the `Barrier` in Redis picks which replica commits.
The writer registers a probe file in /dev/shm with a random token: a trainer that can read it shares our /dev/shm.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import zmq

from proto import checkpointer_pb2 as pb
from services.checkpointer.barrier import Barrier
from services.checkpointer.box_server import BoxServer
from services.checkpointer.control import serve_grpc
from services.checkpointer.layout import TMP_SUFFIX, parse_step
from services.checkpointer.shm import SharedSnapshot, make_shm_probe
from services.checkpointer.store import CheckpointStore
from services.common import grpc_server, logs, net, procs, wire
from services.common.config import Config, load_config
from services.common.registry import Registry, redis_url

log = logs.logger("checkpointer")

SERVICE = "checkpointer"
SAVE_TIMEOUT_S = 600.0  # a save whose ranks have not all arrived by then is abandoned (a rank died mid-save)
MAX_ERRORS_KEPT = 64  # failed steps whose errors a waiting `Save` can still read
WRITE_THREADS = min(8, os.cpu_count() or 1)  # files written at once; disks want a few streams, sha256 wants cores


@dataclass
class PendingSave:
    run: str
    step: int
    world_size: int
    session: str
    started: float = field(default_factory=time.monotonic)
    barrier_start: float = 0.0  # Redis clock when this writer saw the save's first part (see Barrier.outcome)
    parts: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)  # rank -> part -> written entry
    tasks: dict[int, dict[int, Future]] = field(default_factory=dict)  # rank -> part -> its file being written
    maps: dict[int, SharedSnapshot] = field(default_factory=dict)  # rank -> its snapshot file, while parts read it
    received: set[int] = field(default_factory=set)  # ranks whose last part arrived
    reaped: set[int] = field(default_factory=set)  # ranks whose parts are all written (or failed) and handled
    aborted: bool = False  # a failed save's staging directory was removed (once no task writes into it any more)
    num_parts: dict[int, int] = field(default_factory=dict)
    extras: dict[int, dict[str, Any]] = field(default_factory=dict)
    identities: dict[int, bytes] = field(default_factory=dict)  # rank -> ROUTER identity, once its last part came
    done: set[int] = field(default_factory=set)  # ranks whose record is on disk
    answered: set[int] = field(default_factory=set)
    error: str = ""
    awaiting_commit: bool = False  # all local ranks recorded; another replica commits (multi-writer)
    committed: bool = False


@dataclass
class WriterStats:
    committed: int = 0
    failed: int = 0
    last_error: str = ""
    errors: dict[int, str] = field(default_factory=dict)  # the latest failed steps' errors (`Save(wait)` reads them)


class Writer:
    def __init__(self, store: CheckpointStore, registry: Registry | None, host: str = "127.0.0.1", advertise: str = "",
                 save_timeout_s: float = SAVE_TIMEOUT_S, instance: str | None = None,
                 write_threads: int = WRITE_THREADS, token: str | None = None):
        """`host`: the interface to bind; `advertise`: the host clients dial (net.advertised); `token`: the one every
        part must carry (None: FOLDMOE_AUTH_TOKEN, see services/common/net.py)."""
        self.store, self.registry = store, registry
        self.token = net.auth_token() if token is None else token
        self.pool = ThreadPoolExecutor(max_workers=max(1, write_threads), thread_name_prefix="ckpt-write")
        self.max_queued_frames = 2 * max(1, write_threads)  # parts received over ZMQ awaiting a thread (bounds memory)
        self.save_timeout_s = save_timeout_s
        self.instance = instance or f"{socket.gethostname()}-{os.getpid()}"
        self.barrier = Barrier(registry, self.instance) if registry is not None else None
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{net.advertised(host, advertise)}:{port}"
        self.pending: dict[int, PendingSave] = {}
        self.stats = WriterStats()
        self.lock = threading.Lock()  # guards `pending` and `stats` against the gRPC threads reading them

    # ------------------------------------------------------------ the loop

    def serve(self, stop: threading.Event) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not stop.is_set():
            busy = self._writing()
            # Backpressure: parts that came as frames hold their bytes in memory until written; stop reading the
            # socket (the senders block on ZMQ's high-water mark) while enough of them wait for a thread.
            if busy < self.max_queued_frames and dict(poller.poll(10 if busy else 100)).get(self.sock):
                frames = self.sock.recv_multipart(copy=False)
                self._on_message(frames[0].bytes, frames[1:])
            elif busy >= self.max_queued_frames:
                time.sleep(0.005)
            self._reap()
            self._check_remote_commits()
            self._expire()
        with self.lock:
            unfinished = sorted(self.pending)
        log.info("stopping (%s)", f"saves of steps {unfinished} left uncommitted; waiting for their writes in progress"
                 if unfinished else "no save in progress")
        self.sock.close()
        self.pool.shutdown(wait=True)
        with self.lock:
            for save in self.pending.values():
                for rank in list(save.maps):
                    save.maps.pop(rank).close()

    def _writing(self) -> int:
        """Parts received as frames whose file is not written yet."""
        with self.lock:
            return sum(1 for save in self.pending.values() for rank, tasks in save.tasks.items()
                       if rank not in save.maps for f in tasks.values() if not f.done())

    def _on_message(self, identity: bytes, frames: list) -> None:
        try:
            kind, header, tensors = wire.decode(frames, pb.ShardHeader, token=self.token)
        except wire.Unauthenticated as e:
            self._refuse(identity, e)
            return
        except wire.WireError as e:
            log.error("dropping a malformed message: %s", e)
            return
        if kind != "ckpt.shard":
            log.error("dropping a message of kind %r (expected 'ckpt.shard')", kind)
            return
        with self.lock:
            save = self._pending_for(header)
            try:
                self._accept_part(save, header, tensors)
            except Exception as e:  # bad shm path, bad extra JSON: the save fails, the service lives on
                self._fail(save, f"rank {header.rank} part {header.part}: {type(e).__name__}: {e}")
            if header.part == header.num_parts - 1:
                save.identities[header.rank] = identity
                save.received.add(header.rank)
                if save.error:
                    self._answer(save, header.rank)
            self._forget_if_answered(save)

    def _pending_for(self, h: pb.ShardHeader) -> PendingSave:
        save = self.pending.get(h.step)
        if save is not None and save.session != h.session:
            # A restarted trainer saves this step again; the old incarnation's ranks will never complete it.
            self._fail(save, f"superseded by a new trainer session {h.session!r}")
            for tasks in save.tasks.values():  # its files share our staging directory: let them finish first
                for f in tasks.values():
                    f.cancel() or f.exception()
            self._settle(save)
            self._drop(save)
            save = None
        if save is None:
            save = PendingSave(h.run, h.step, h.world_size, h.session)
            if self.barrier is not None:
                save.barrier_start = self.barrier.now()
            self.pending[h.step] = save
            log.info("save of step %d started (%d ranks)", h.step, h.world_size)
        return save

    def _accept_part(self, save: PendingSave, h: pb.ShardHeader, tensors: dict) -> None:
        """Validate one part and hand its file to a write thread."""
        if save.error:
            return
        if h.world_size != save.world_size or h.rank >= save.world_size:
            raise ValueError(f"rank {h.rank} claims world_size {h.world_size}, the save has {save.world_size}")
        if h.part == 0:
            save.extras[h.rank] = json.loads(h.extra.decode() or "{}")
        boxes = {r.name: (list(r.global_shape), list(r.offsets)) for r in h.tensors}
        if h.shm_path:
            if tensors:
                raise ValueError("a part naming a shared-memory file must not also carry tensor frames")
            shared = save.maps.get(h.rank)
            if shared is None or shared.path != h.shm_path:
                shared = save.maps[h.rank] = SharedSnapshot(h.shm_path)
            tensors = {r.name: shared.blob(r) for r in h.tensors}
        missing = set(tensors) ^ set(boxes)
        if missing:
            raise ValueError(f"tensors without a record or records without a tensor: {sorted(missing)}")
        for r in h.tensors:  # 0-d tensors travel as [1] (see handoff.WriterLink._send)
            if not h.shm_path and not r.global_shape and tensors[r.name].numel() == 1:
                tensors[r.name] = tensors[r.name].reshape(())
        save.num_parts[h.rank] = h.num_parts
        save.tasks.setdefault(h.rank, {})[h.part] = self.pool.submit(self._write_file, save, h.rank, h.part, tensors,
                                                                      boxes)

    def _write_file(self, save: PendingSave, rank: int, part: int, tensors: dict, boxes: dict) -> dict[str, Any]:
        """Runs on a write thread; a save that already failed writes nothing more into its doomed directory."""
        if save.error:
            raise RuntimeError("skipped: the save had already failed")
        return self.store.write_part(save.step, rank, part, tensors, boxes)

    def _reap(self) -> None:
        """Finish each rank whose parts have all been written; fail the save on a part that could not be."""
        with self.lock:
            for save in list(self.pending.values()):
                for rank in sorted(save.received - save.reaped):
                    tasks = save.tasks.get(rank, {})
                    if not all(f.done() for f in tasks.values()):
                        continue
                    save.reaped.add(rank)
                    if rank in save.maps:
                        save.maps.pop(rank).close()
                    for part in sorted(tasks):
                        e = None if save.error else tasks[part].exception()
                        if e is not None:
                            self._fail(save, f"rank {rank} part {part}: {type(e).__name__}: {e}")
                        elif not save.error:
                            save.parts.setdefault(rank, {})[part] = tasks[part].result()
                    if save.error:
                        self._answer(save, rank)
                    else:
                        self._finish_rank(save, rank)
                self._forget_if_answered(save)

    def _settled(self, save: PendingSave) -> bool:
        return all(f.done() for tasks in save.tasks.values() for f in tasks.values())

    def _settle(self, save: PendingSave) -> None:
        """Wait for the save's write threads (used only when the save is being abandoned), then clean up after it."""
        for tasks in save.tasks.values():
            for f in tasks.values():
                if not f.cancelled():
                    f.exception()
        for rank in list(save.maps):
            save.maps.pop(rank).close()
        if save.error and not save.aborted:
            self.store.abort(save.step)
            save.aborted = True

    def _finish_rank(self, save: PendingSave, rank: int) -> None:
        parts = save.parts.get(rank, {})
        if len(parts) != save.num_parts.get(rank, -1):
            self._fail(save, f"rank {rank} sent {len(parts)} of {save.num_parts.get(rank)} parts")
            self._answer(save, rank)
            return
        try:
            self.store.write_rank_record(save.step, rank, [parts[i] for i in sorted(parts)], save.extras.get(rank, {}))
        except Exception as e:
            self._fail(save, f"rank {rank} record: {type(e).__name__}: {e}")
            self._answer(save, rank)
            return
        save.done.add(rank)
        if self.barrier is None:
            if len(save.done) == save.world_size:
                self._commit(save)
            return
        if self.barrier.arrive(save.run, save.step, save.session, rank, save.world_size):
            self._commit(save)
        else:
            save.awaiting_commit = True

    def _commit(self, save: PendingSave) -> None:
        try:
            path = self.store.commit(save.run, save.step, save.world_size)
        except Exception as e:
            self._fail(save, f"commit: {type(e).__name__}: {e}")
            return
        log.info("committed step %d at %s", save.step, path)
        self.stats.committed += 1
        save.committed = True
        if self.registry is not None:
            self.registry.set_state("checkpoint/latest", {"step": save.step, "path": str(path)})
        if self.barrier is not None:
            self.barrier.publish(save.run, save.step, save.session, save.barrier_start, str(path), "")
        self._answer_all(save, path=str(path))

    def _check_remote_commits(self) -> None:
        """Multi-writer: answer local ranks once the replica that committed has published the outcome."""
        if self.barrier is None:
            return
        with self.lock:
            for save in [s for s in self.pending.values() if not s.error and not s.committed]:
                outcome = self.barrier.outcome(save.run, save.step, save.session, save.barrier_start)
                if outcome is None:
                    continue
                path, error = outcome
                if error:  # another replica failed this save: stop writing it and tell our ranks
                    self._fail(save, f"on another writer replica: {error}")
                elif save.awaiting_commit:
                    save.awaiting_commit, save.committed = False, True
                    self.stats.committed += 1
                    self._answer_all(save, path=path)
                self._forget_if_answered(save)

    # ------------------------------------------------------------ answers and failure

    def _answer(self, save: PendingSave, rank: int, path: str = "") -> None:
        identity = save.identities.get(rank)
        if identity is None or rank in save.answered:
            return
        result = pb.SaveResult(step=save.step, path="" if save.error else path, error=save.error)
        kind = "ckpt.failed" if save.error else "ckpt.committed"
        self.sock.send_multipart([identity, *wire.encode(kind, result)])  # ROUTER: identity frame first
        save.answered.add(rank)

    def _refuse(self, identity: bytes, e: wire.Unauthenticated) -> None:
        """Fail an unauthenticated part's save for its sender alone; the parts of authenticated ranks are untouched."""
        header = pb.ShardHeader()
        try:
            header.ParseFromString(e.body)
        except Exception:  # noqa: BLE001 -- the refusal must go out even when the header is garbage
            pass
        log.error("refusing a part from rank %d for step %d: %s", header.rank, header.step, e)
        result = pb.SaveResult(step=header.step, error=f"checkpointer refused the save: {e}")
        self.sock.send_multipart([identity, *wire.encode("ckpt.failed", result)])

    def _answer_all(self, save: PendingSave, path: str = "") -> None:
        for rank in list(save.identities):
            self._answer(save, rank, path)

    def _fail(self, save: PendingSave, error: str) -> None:
        if save.error:
            return
        save.error = f"save of step {save.step} failed: {error}"
        log.error("%s", save.error)
        self.stats.failed += 1
        self.stats.last_error = save.error
        self.stats.errors[save.step] = save.error
        if len(self.stats.errors) > MAX_ERRORS_KEPT:
            del self.stats.errors[next(iter(self.stats.errors))]  # the oldest
        for tasks in save.tasks.values():
            for f in tasks.values():
                f.cancel()
        if self._settled(save):  # else the staging directory goes once the last running write ends (_forget_if_answered)
            self.store.abort(save.step)
            save.aborted = True
        if self.barrier is not None:
            self.barrier.publish(save.run, save.step, save.session, save.barrier_start, "", save.error)
        self._answer_all(save)

    def _forget_if_answered(self, save: PendingSave) -> None:
        # A failed save stays as a tombstone until every rank was told (or it expires), so a rank whose parts arrive
        # after the failure is answered at once instead of opening a new save that can never complete.
        if save.error and not save.aborted and self._settled(save):
            self._settle(save)
        if len(save.answered) == save.world_size or (save.committed and save.answered >= set(save.identities)):
            if self._settled(save) and (save.aborted or not save.error):
                self._drop(save)

    def _drop(self, save: PendingSave) -> None:
        if self.pending.get(save.step) is save:
            del self.pending[save.step]

    def _expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            for save in list(self.pending.values()):
                if now - save.started > self.save_timeout_s:
                    if not save.error and not save.committed:
                        # the first few only: world_size is a uint32 from the wire, not a list to build
                        done = set(save.identities)
                        missing = list(itertools.islice((r for r in range(save.world_size) if r not in done), 8))
                        more = " ..." if save.world_size - len(done) > len(missing) else ""
                        self._fail(save, f"ranks {missing}{more} did not finish within {self.save_timeout_s:.0f}s")
                    if self._settled(save):
                        self._settle(save)
                        self._drop(save)

    def error_of(self, step: int) -> str:
        """Why the save of `step` failed, "" when it has not (or the failure is too old to be kept)."""
        with self.lock:
            return self.stats.errors.get(step, "")

    def status(self) -> pb.SaveStatusReply:
        latest = self.store.latest_step()
        with self.lock:
            now = time.monotonic()
            pending = [pb.PendingSave(step=s.step, world_size=s.world_size, ranks_done=len(s.done),
                                      age_s=now - s.started)
                       for s in self.pending.values() if not s.error and not s.committed]
            return pb.SaveStatusReply(latest_step=latest,
                                      latest_path=str(self.store.final_dir(latest)) if latest >= 0 else "",
                                      pending=pending, last_error=self.stats.last_error,
                                      saves_committed=self.stats.committed, saves_failed=self.stats.failed)


# ---------------------------------------------------------------- process entry


def host_name() -> str:
    """The host this process registers under; FOLDMOE_HOST overrides it (containers, tests of several replicas)."""
    return os.environ.get("FOLDMOE_HOST") or socket.gethostname()


def forget_stale_arrivals(registry: Registry, removed: list[Path]) -> None:
    """Drop the commit barrier's record of ranks whose staged files `clean_stale` just removed.

    A writer killed mid-save leaves in Redis the ranks it had recorded (Barrier.arrive) for that step and session; the
    trainer then re-sends the whole save to this replacement (handoff.WriterLink), under the same step and session.
    The barrier counts only registered replicas' arrivals, but the killed writer's registry record lingers until its
    heartbeat lapses, and the first re-sent part can arrive inside that window: were the old entries kept, that rank
    would complete the count and this writer would commit with the other ranks' parts missing. Runs before this writer
    registers, so before any re-sent part can arrive."""
    barrier = Barrier(registry, "")
    for p in removed:
        if not p.name.endswith(TMP_SUFFIX) or (step := parse_step(p.name.removesuffix(TMP_SUFFIX))) is None:
            continue
        try:
            for what in ("ranks", "claim"):  # the session is a glob here: every incarnation's keys for this step
                for key in registry.client.scan_iter(match=barrier._key(registry.run, step, "*", what)):
                    registry.client.delete(key)
        except redis.RedisError as e:
            log.warning("could not clear the commit barrier of the interrupted save of step %d (%s)", step, e)


def run(cfg: Config, stop: threading.Event) -> None:
    store = CheckpointStore(cfg.checkpoint.dir, cfg.checkpoint.keep_last)
    registry = Registry(redis_url(), cfg.run.name)
    stale = store.clean_stale()
    for p in stale:
        log.warning("removed %s left by an interrupted save or delete", p)
    forget_stale_arrivals(registry, stale)
    writer = Writer(store, registry, cfg.run.bind_host, cfg.run.advertise_host)
    control, grpc_addr = serve_grpc(store, writer, cfg.run.bind_host, cfg.run.advertise_host, writer.token)
    boxes = BoxServer(store, cfg.run.bind_host, cfg.run.advertise_host, writer.token).start()
    probe, token = make_shm_probe()
    heartbeat = registry.register(SERVICE, {"zmq": writer.endpoint, "grpc": grpc_addr, "load": boxes.endpoint,
                                            "host": host_name(),
                                            "dir": str(Path(cfg.checkpoint.dir).resolve()), "store_id": store.store_id,
                                            "shm_probe": probe,
                                            "shm_token": token}, instance=writer.instance)
    log.info("checkpointer writing to %s with %d threads; zmq %s, grpc %s, shared memory %s", cfg.checkpoint.dir,
             writer.pool._max_workers, writer.endpoint, grpc_addr, "probe " + probe if probe else "unavailable")
    try:
        writer.serve(stop)
    finally:
        heartbeat.stop()
        grpc_server.stop(control, grace=1.0)
        boxes.close()
        if probe:
            Path(probe).unlink(missing_ok=True)
        log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.checkpointer.writer", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=None, help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args(argv)
    logs.configure("checkpointer")
    stop = threading.Event()
    try:
        procs.stop_on_signals(stop)  # first: a malformed stop grace fails before anything is started
        cfg = load_config(args.config, args.overrides)
    except ValueError as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    run(cfg, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
