"""Trainer side of a checkpoint: copy this rank's shards to host memory, hand them to a writer, keep training.

The stall is only *enqueuing* the device-to-host copies:
- the host buffers (`common/host_memory.HostArena`, page-locked, in /dev/shm when possible) are allocated once, ahead of the first
  save, by `prepare` (in a background thread);
- `save` orders a side CUDA stream after the training stream and returns; a copier thread then queues the
  device-to-host copies on that stream `DRAIN_CHUNK_BYTES` at a time, at most two chunks in flight, and the sender
  thread hands the buffers to the writer once the last one has landed. While they run, any other device-to-host copy
  waits for all of them (the copy engine serves them in order, however they are queued: bench/bench_copy_engine.py),
  so the trainer copies its step values on a stream of its own and does not wait for them meanwhile (`copying`,
  services/trainer/metrics.py). Queued in chunks rather than all at once, the next step's forward and backward ran
  beside the copy through the launcher (bench/RESULTS.md; why the all-at-once queue held them was not found);
- the copies read the live parameters and optimizer state, so the next optimizer step must not start before they end:
  `fence()` (call it right before the optimizer step; `services/trainer/checkpointing.py` installs it as an optimizer
  step pre-hook) makes the training stream wait for the last copy. If the copier has not queued it yet, the host
  waits until it has; the device meanwhile runs the forward and backward already queued. So without staging a save
  costs a step (copy time - forward/backward time of one step), which `bench/bench_checkpoint.py` measures;
- `stage_on_device=True` (config `checkpoint.stage_on_device`) takes that off the step when the device has memory to
  spare (one more copy of the rank's state): `save` first copies the state into a device buffer on the side stream
  (HBM to HBM, ~20x faster than over PCIe), the fence waits only for that, and the copier drains the buffer to the
  host in the background. Without the memory (allocation fails) the save copies straight to the host, with a warning.
On CPU the copy is a synchronous memcpy.

With `host_buffers=N`, up to N saves can be in flight; a save requested while all N are still being written either
waits (`on_busy="wait"`) or is skipped (`"skip"`). A failed save is reported by the next `save` or `wait`, never lost.
Once copied, a save goes to the writer through `handoff.WriterLink` (shared memory or ZMQ frames; re-sent whole to a
restarted writer); its host buffer is held until the save is committed or has finally failed.
"""

from __future__ import annotations

import json
import os
import queue
import socket as socketlib
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from proto import checkpointer_pb2 as pb
from services.checkpointer.handoff import Parcel, SaveError, WriterLink
from services.checkpointer.shard import Shard, as_shard
from services.common import logs, net
from services.common.host_memory import HostArena, TensorSpec, remove_stale_files
from services.common.registry import Registry

log = logs.logger("checkpointer")

PART_BYTES = 256 << 20  # bytes per part: one file on disk, one ZMQ message, one writer task (the unit of parallelism)
DRAIN_CHUNK_BYTES = 64 << 20  # device-to-host bytes queued per chunk (~1.2 ms at 55 GB/s; see the module doc)


@dataclass
class _Drain:
    """A save's device-to-host copies, queued by the copier thread a chunk at a time (`Snapshotter._drain`)."""
    device: torch.device
    copies: list[tuple[torch.Tensor, torch.Tensor]]  # (host buffer, device source); holds the sources until copied
    queued: threading.Event = field(default_factory=threading.Event)  # set once the last copy is queued: `done`
    done: Any = None  # CUDA event after the last copy


@dataclass
class _Job:
    """A save between `save` and its answer: copied by the copier thread, then delivered by the sender thread."""
    parcel: Parcel
    drain: _Drain | None = None  # the device-to-host copies; None when nothing was on a GPU (or already copied)
    error: str = ""  # set by the copier thread when the copies failed


def specs_of(shards: dict[str, torch.Tensor | Shard]) -> dict[str, TensorSpec]:
    """The buffers a save of `shards` needs (only the pieces this rank writes)."""
    out = {}
    for name, value in shards.items():
        shard = as_shard(value)
        if shard.written:
            out[name] = TensorSpec.of(shard.tensor)
    return out


class Snapshotter:
    def __init__(self, endpoint: str | None = None, *, registry: Registry | None = None, rank: int = 0,
                 world_size: int = 1, run: str = "", on_busy: Literal["wait", "skip"] = "wait", session: str = "",
                 timeout_s: float = 600.0, host: str | None = None, part_bytes: int = PART_BYTES,
                 host_buffers: int = 1, share_memory: bool = True, token: str | None = None,
                 stage_on_device: bool = False):
        """`endpoint`: a writer's ZMQ address; or `registry`: find the writer registered for this host.

        `session` must be the same on every rank of one trainer incarnation and differ between incarnations (e.g. a
        uuid broadcast from rank 0): a writer then never mixes a restarted job's parts with a crashed one's.
        `host_buffers`: snapshot buffers (each the size of this rank's state); 2 lets a save start while the previous
        one is still being written. `share_memory=False` keeps the buffers private (always ZMQ).
        `stage_on_device`: snapshot into a device buffer first (see the module doc). `token`: the
        writer's auth token (None: FOLDMOE_AUTH_TOKEN, see services/common/net.py).
        """
        if endpoint is None and registry is None:
            raise ValueError("Snapshotter needs a writer `endpoint` or a `registry` to find one in")
        if on_busy not in ("wait", "skip"):
            raise ValueError(f"on_busy={on_busy!r} must be 'wait' or 'skip'")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if host_buffers < 1:
            raise ValueError(f"host_buffers={host_buffers} must be at least 1")
        self.endpoint, self.registry = endpoint, registry
        self.token = net.auth_token() if token is None else token
        self.rank, self.world_size = rank, world_size
        self.run = run or (registry.run if registry is not None else "")
        self.on_busy, self.session, self.timeout_s = on_busy, session, timeout_s
        self.host = host or os.environ.get("FOLDMOE_HOST") or socketlib.gethostname()  # as the writer registers
        self.part_bytes, self.host_buffers, self.share_memory = part_bytes, host_buffers, share_memory
        self.sync_copy = False  # True: `save` returns only after the copy (for optimizers `fence` cannot hook into)
        self._pin = torch.cuda.is_available()
        self._cond = threading.Condition()
        self._free: list[HostArena] = []  # prepared or returned arenas, not in any job
        self._in_flight = 0  # jobs queued or being written
        self._preparing: threading.Thread | None = None
        self._prepare_error: BaseException | None = None
        self._stream = None  # side CUDA stream for the device-to-host copies (created at the first GPU save)
        self._unfenced = None  # the latest save's copies not yet ordered before a step by `fence`: a _Drain, or
        #                        (device, event) of a staged save's device-to-device copy
        self._last_drain: _Drain | None = None  # the latest staged save's drain (it reads the staging buffer)
        self._copying = 0  # saves whose device-to-host copies have not all landed
        self.stage_on_device = stage_on_device
        self._staging: tuple[dict, dict[str, torch.Tensor]] | None = None  # (specs, device views) for staged saves
        self._error: SaveError | None = None
        self._last_path = ""
        self._jobs: queue.Queue[_Job | None] = queue.Queue()  # saves to copy (the copier thread)
        self._copied: queue.Queue[_Job | None] = queue.Queue()  # saves copied, to send (the sender thread)
        self._link = WriterLink(endpoint, registry, rank=rank, world_size=world_size, run=self.run,
                                session=session, host=self.host, token=self.token, timeout_s=timeout_s)
        # Two threads, so that a save's copies never wait for the previous save's (long) delivery.
        self._copier = threading.Thread(target=self._copy_jobs, name=f"snapshot-copy-rank{rank}", daemon=True)
        self._thread = threading.Thread(target=self._sender, name=f"snapshot-rank{rank}", daemon=True)
        self._copier.start()
        self._thread.start()
        # Telemetry.
        self.last_stall_s = 0.0  # seconds the latest accepted save held the caller
        self.last_copy_s = 0.0  # device-to-host copy time of the latest save that finished copying (CUDA events)
        self.fence_waits = 0  # fences that found the copy still running (the GPU waited for it)
        self.unprepared_saves = 0  # saves that had to allocate (or re-layout) their buffers

    # ------------------------------------------------------------ buffers

    def prepare(self, shards: dict[str, torch.Tensor | Shard] | dict[str, TensorSpec], background: bool = True) -> None:
        """Allocate (and pin) the host buffers for saves of `shards` now, so no save pays for it. Specs or the tensors
        themselves; a later save with other shapes re-allocates (logged)."""
        specs = {n: v if isinstance(v, TensorSpec) else TensorSpec.of(as_shard(v).tensor)
                 for n, v in shards.items() if isinstance(v, TensorSpec) or as_shard(v).written}
        device = next((as_shard(v).tensor.device for v in shards.values() if not isinstance(v, TensorSpec)
                       and as_shard(v).tensor.device.type == "cuda"), None)
        if device is not None:
            self._side_stream(device)  # creating it the first time waits for the device (measured on an H100)
        self._join_prepare()
        with self._cond:
            missing = self.host_buffers - self._in_flight - len(self._free)
        if missing <= 0:
            return

        def allocate() -> None:
            try:
                start = time.perf_counter()
                remove_stale_files()
                arenas = [self._new_arena(specs) for _ in range(missing)]
                with self._cond:
                    self._free.extend(arenas)
                log.info("rank %d: %d snapshot buffer(s) of %.2f GB ready in %.1fs (%s)", self.rank, missing,
                         arenas[0].size / 1e9 if arenas else 0.0, time.perf_counter() - start,
                         "shared memory" if arenas and arenas[0].shared else "private memory")
            except BaseException as e:  # reported by the next save; that save allocates itself
                self._prepare_error = e

        if background:
            self._preparing = threading.Thread(target=allocate, name=f"snapshot-prepare-rank{self.rank}", daemon=True)
            self._preparing.start()
        else:
            allocate()

    def _new_arena(self, specs: dict[str, TensorSpec]) -> HostArena:
        return HostArena(specs, pin=self._pin, shared=self.share_memory, tag=f"rank{self.rank}-")

    def _join_prepare(self) -> None:
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None
        if self._prepare_error is not None:
            error, self._prepare_error = self._prepare_error, None
            log.warning("rank %d: preparing snapshot buffers failed (%s); the save allocates them", self.rank, error)

    def _take_arena(self, specs: dict[str, TensorSpec]) -> HostArena:
        self._join_prepare()
        with self._cond:
            arena = next((a for a in self._free if a.matches(specs)), None)
            if arena is None and self._free:
                self._free.pop().close()  # the state changed shape: its buffers are of no use any more
            elif arena is not None:
                self._free.remove(arena)
        if arena is None:
            self.unprepared_saves += 1
            log.warning("rank %d: no prepared snapshot buffer fits this save; allocating %.2f GB now (call "
                        "Snapshotter.prepare ahead of the first save to keep this off the training step)", self.rank,
                        sum(s.nbytes for s in specs.values()) / 1e9)
            arena = self._new_arena(specs)
        return arena

    def _release(self, arena: HostArena, reusable: bool) -> None:
        with self._cond:
            if reusable:
                self._free.append(arena)
            else:
                arena.close()
            self._in_flight -= 1
            self._cond.notify_all()

    # ------------------------------------------------------------ caller side

    @property
    def copying(self) -> bool:
        """A save's device-to-host copies are still running. Meanwhile every other device-to-host copy waits for them
        (the copy engine serves them in order), so the trainer does not wait for its step values then (train.py)."""
        with self._cond:
            return self._copying > 0

    @property
    def last_shared(self) -> bool:
        """The latest sent save went through shared memory (else ZMQ frames)."""
        return self._link.last_shared

    @property
    def busy(self) -> bool:
        """Every snapshot buffer is in a save still being written. With on_busy="skip" ranks must skip together (a
        step saved by some ranks only never commits): see `services/trainer/checkpointing.should_skip`."""
        with self._cond:
            return self._in_flight >= self.host_buffers

    def save(self, step: int, shards: dict[str, torch.Tensor | Shard], extra: dict[str, Any] | None = None,
             skip_if_busy: bool | None = None) -> bool:
        """Snapshot `shards` for `step`; True when accepted, False when skipped because every buffer is busy.
        `skip_if_busy` overrides `on_busy` for this call (the trainer passes the world's agreed decision)."""
        skip = self.on_busy == "skip" if skip_if_busy is None else skip_if_busy
        with self._cond:
            if self._in_flight >= self.host_buffers:
                if skip:
                    log.warning("rank %d: checkpoint of step %d skipped, the previous save is still being written",
                                self.rank, step)
                    return False
                self._cond.wait_for(lambda: self._in_flight < self.host_buffers)
        self._raise_pending_error()
        start = time.perf_counter()
        normalized = {name: as_shard(v) for name, v in shards.items()}
        for name, shard in normalized.items():
            shard.check(name)
        try:
            extra_bytes = json.dumps(extra or {}).encode()
        except TypeError as e:
            raise ValueError(f"checkpoint extra must be JSON-serialisable ({e}); send tensors (e.g. RNG states) as "
                             "shards instead") from None
        written = {n: s for n, s in normalized.items() if s.written}
        arena = self._take_arena({n: TensorSpec.of(s.tensor) for n, s in written.items()})
        drain = self._copy(written, arena)
        if drain is not None and self.sync_copy:
            self._drain(drain)
            drain = None
        with self._cond:
            self._in_flight += 1
        self._jobs.put(_Job(Parcel(step, arena, self._split(written, arena), extra_bytes), drain))
        self.last_stall_s = time.perf_counter() - start
        return True

    def fence(self) -> None:
        """Order the latest snapshot's copies before whatever the caller's CUDA stream runs next (the optimizer step
        that overwrites the saved tensors). A no-op once the copy has finished; blocks the host only while the copier
        has not yet queued an unstaged save's last copy."""
        pending, self._unfenced = self._unfenced, None
        if isinstance(pending, _Drain):  # copies straight from the live tensors: the last one, once it is queued
            pending.queued.wait()
            device, done = pending.device, pending.done  # (None: the copies failed; the save reports it)
        elif pending is not None:  # staged: the device-to-device copy
            device, done = pending
        if pending is None or done is None or done.query():
            return
        torch.cuda.current_stream(device).wait_event(done)
        self.fence_waits += 1

    def wait(self, timeout: float | None = None) -> str:
        """Block until every save in flight is committed; returns the latest path, raises SaveError with the reason."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._in_flight == 0, timeout):
                raise TimeoutError(f"rank {self.rank}: the checkpoint save is still in flight after {timeout}s")
        self._raise_pending_error()
        return self._last_path

    def close(self) -> None:
        """Finish the saves in flight (errors are logged, not raised), stop the copier and sender threads, free the
        buffers."""
        self._join_prepare()
        with self._cond:
            self._cond.wait_for(lambda: self._in_flight == 0)
        self._jobs.put(None)
        self._copier.join()
        self._thread.join()
        with self._cond:
            for arena in self._free:
                arena.close()
            self._free = []
        if self._error is not None:
            log.error("rank %d: %s", self.rank, self._error)

    def _raise_pending_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _copy(self, shards: dict[str, Shard], arena: HostArena) -> _Drain | None:
        """Copy the host shards into their buffers now; returns the device shards' copies for the copier to queue
        (`_drain`), ordered after the training stream's work so far (None when nothing is on a GPU). Staged, the
        device-to-device copy into the staging buffer is queued here and the drain reads that buffer."""
        on_device = [(n, s.tensor.detach()) for n, s in shards.items() if s.tensor.device.type == "cuda"]
        for name, shard in shards.items():
            if shard.tensor.device.type != "cuda":
                arena.views[name].copy_(shard.tensor.detach())
        if not on_device:
            return None
        device = on_device[0][1].device
        stream = self._side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # copy the values the training stream produced
        staging = self._staging_for(arena, device)
        drain = _Drain(device, [(arena.views[name], src) for name, src in on_device])
        with self._cond:
            self._copying += 1
        if staging is None:
            self._unfenced = drain
            return drain
        if self._last_drain is not None:
            self._last_drain.queued.wait()  # the previous save's drain of the staging buffer is queued before ours
        with torch.cuda.stream(stream):  # HBM -> HBM first; the training stream need only wait for this part
            for name, src in on_device:
                staging[name].copy_(src, non_blocking=True)
                src.record_stream(stream)  # a temporary source (e.g. a contiguous() shard) outlives its caller
            staged = torch.cuda.Event()
            staged.record(stream)
        self._unfenced = (device, staged)
        drain.copies = [(arena.views[name], staging[name]) for name, _ in on_device]
        self._last_drain = drain
        return drain

    def _drain(self, drain: _Drain) -> None:
        """Queue `drain`'s copies on the side stream, `DRAIN_CHUNK_BYTES` at a time with at most two chunks in flight,
        and return once the last has landed (see the module doc)."""
        stream = self._stream
        try:
            try:
                with torch.cuda.device(drain.device), torch.cuda.stream(stream):
                    start = torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    in_flight, queued = None, 0
                    for dst, src in _chunks(drain.copies, DRAIN_CHUNK_BYTES):
                        dst.copy_(src, non_blocking=True)
                        queued += src.numel() * src.element_size()
                        if queued >= DRAIN_CHUNK_BYTES:
                            chunk = torch.cuda.Event()
                            chunk.record(stream)
                            if in_flight is not None:
                                in_flight.synchronize()
                            in_flight, queued = chunk, 0
                    done = torch.cuda.Event(enable_timing=True)
                    done.record(stream)
                drain.done = done
            finally:
                drain.queued.set()  # a fence never waits for copies that will not come (on failure: `done` is None)
            done.synchronize()  # the writer may read the buffers only once the copy has landed
        finally:
            drain.copies = []
            with self._cond:
                self._copying -= 1
        self.last_copy_s = start.elapsed_time(done) / 1e3

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
            torch.cuda.Event(enable_timing=True).record(self._stream)
        return self._stream

    def _staging_for(self, arena: HostArena, device: torch.device) -> dict[str, torch.Tensor] | None:
        """Device buffers laid out like `arena` (allocated at the first staged save, reused while the layout holds;
        the side stream orders a save's staging copy after the previous save's drain). None: stage on the host."""
        if not self.stage_on_device:
            return None
        if self._staging is not None and self._staging[0] == arena.specs:
            return self._staging[1]
        self._staging = None
        try:
            flat = torch.empty(arena.size, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError:
            log.warning("rank %d: no room for a %.2f GB device staging buffer; this save copies straight to the host "
                        "(the next optimizer step waits for the device-to-host copy)", self.rank, arena.size / 1e9)
            return None
        views = {name: flat[arena.offsets[name]:arena.offsets[name] + spec.nbytes].view(spec.dtype).view(spec.shape)
                 for name, spec in arena.specs.items()}
        self._staging = (dict(arena.specs), views)
        return views

    def _split(self, shards: dict[str, Shard], arena: HostArena) -> list[list[pb.TensorRecord]]:
        parts: list[list[pb.TensorRecord]] = [[]]
        size = 0
        for name, s in shards.items():
            spec = arena.specs[name]
            if parts[-1] and size + spec.nbytes > self.part_bytes:
                parts.append([])
                size = 0
            parts[-1].append(pb.TensorRecord(name=name, global_shape=list(s.global_shape), offsets=list(s.offsets),
                                             shm_offset=arena.offsets[name], shape=list(spec.shape),
                                             dtype=str(spec.dtype).removeprefix("torch.")))
            size += spec.nbytes
        return parts

    # ------------------------------------------------------------ copier and sender threads

    def _copy_jobs(self) -> None:
        while (job := self._jobs.get()) is not None:
            if job.drain is not None:
                try:
                    self._drain(job.drain)
                except Exception as e:  # failed by the sender, which owns the job's buffers from here
                    job.error = f"copying it to host memory failed: {e}"
            self._copied.put(job)
        self._copied.put(None)

    def _sender(self) -> None:
        while (job := self._copied.get()) is not None:
            reusable = False
            try:
                if job.error:
                    raise RuntimeError(job.error)
                self._last_path = self._link.deliver(job.parcel)
                reusable = True
            except SaveError as e:
                self._error = e
                reusable = not e.unanswered  # a writer that never answered may still be reading the buffers
            except Exception as e:
                self._error = SaveError(f"rank {self.rank}: checkpoint of step {job.parcel.step} failed: {e}")
            finally:
                if not reusable:
                    self._link.disconnect()
                # Only now: a re-send reads the buffers until the save is decided.
                self._release(job.parcel.arena, reusable)
        self._link.disconnect()


def _chunks(copies: list[tuple[torch.Tensor, torch.Tensor]], chunk_bytes: int):
    """(host buffer, source) pairs with every contiguous source larger than `chunk_bytes` cut into byte ranges."""
    for dst, src in copies:
        nbytes = src.numel() * src.element_size()
        if nbytes <= chunk_bytes or not (src.is_contiguous() and dst.is_contiguous()):
            yield dst, src
            continue
        dst_bytes, src_bytes = dst.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)
        for lo in range(0, nbytes, chunk_bytes):
            yield dst_bytes[lo:lo + chunk_bytes], src_bytes[lo:lo + chunk_bytes]


def new_session() -> str:
    """A fresh session id for one trainer incarnation (broadcast it from rank 0 to all ranks)."""
    return uuid.uuid4().hex
