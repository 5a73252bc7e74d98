"""Trainer side of policy weight sync: serve versioned copies of the weights to the rollout workers.

`publish(version, state_dict)` copies the full tensors to host memory in the sync dtype (bf16 by default; integer buffers
keep theirs), cuts them into chunks of about `chunk_bytes`, and serves them from a background thread over a ZMQ ROUTER
socket; the exchange is `proto/rollout.proto` (WeightsRequest / WeightsManifest / WeightsChunk / WeightsError). A
sharded trainer streams the full tensors into `new_version`'s buffers as it gathers them (`parallel/gather_weights.py`,
already cast). Workers pull (the trainer never pushes), so a worker that starts late, or restarts, gets the current
weights, and no worker can slow the trainer down: the trainer's cost is the one host copy.

That copy lands in page-locked buffers (`common/host_memory.HostArena`, exactly the bytes needed), so device tensors
come over at the copy engine's rate, queued without a wait each, with one wait at the end: a pageable copy per tensor
ran at ~1.3 GB/s (bench/RESULTS.md). Page-locking costs about as much as the copy, so a dropped version's buffers
are reused by a later one, once ZMQ has let go of every frame sent from them (the frames are sent zero-copy and
tracked): a worker still receiving an old chunk never sees it overwritten. The first `keep + 1` versions' buffers
are page-locked in the background ahead of use (`prepare`, called as the trainer starts). The buffers are a file in /dev/shm where
it has room (`FOLDMOE_SHM_DIR`); its path and the tensors' places go in the manifest, and a worker that can open it
(same host and mount) reads the tensors from it rather than over TCP, then asks whether the version is still kept:
buffers are reused only after their version is dropped, so a yes means the read was whole.

The worker side is `services/rl_rollout/weights.py`; the two share only the proto messages. With FOLDMOE_AUTH_TOKEN
set, requests without it are answered with a `WeightsError` (services/common/net.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import zmq

from proto import rollout_pb2 as pb
from services.common import logs, net, wire
from services.common.host_memory import HostArena, TensorSpec, remove_stale_files

log = logs.logger("trainer")

Chunk = tuple[list[pb.WeightPiece], list[torch.Tensor]]


def sync_dtype(rl) -> torch.dtype:
    """The dtype floating weights travel in, from the `rl` config section's `weight_dtype`."""
    return torch.bfloat16 if rl.weight_dtype == "bf16" else torch.float32


def chunk_state(state: dict[str, torch.Tensor], chunk_bytes: int) -> list[Chunk]:
    """Cut the tensors, flattened, into pieces so that no chunk holds much more than `chunk_bytes`."""
    chunks: list[Chunk] = [([], [])]
    room = chunk_bytes
    for name, t in state.items():
        flat, offset = t.reshape(-1), 0
        while True:
            if room <= 0:
                chunks.append(([], []))
                room = chunk_bytes
            n = min(flat.numel() - offset, max(1, room // t.element_size()))
            chunks[-1][0].append(pb.WeightPiece(name=name, shape=list(t.shape), offset=offset, numel=n))
            chunks[-1][1].append(flat[offset:offset + n])
            room, offset = room - n * t.element_size(), offset + n
            if offset >= flat.numel():
                break
    return chunks


@dataclass
class _Version:
    """A published version: its host buffers, its chunks (views of them), and the sends ZMQ may still read them for."""

    arena: HostArena
    chunks: list[Chunk]
    manifest: pb.WeightsManifest | None = None  # None: filled and dropped unpublished (an error while filling)
    sends: list[zmq.MessageTracker] = field(default_factory=list)

    def sent(self) -> bool:
        return all(t.done for t in self.sends)


def _manifest(version: int, arena: HostArena, chunks: list[Chunk]) -> pb.WeightsManifest:
    total = sum(t.numel() * t.element_size() for _, ts in chunks for t in ts)
    manifest = pb.WeightsManifest(version=version, num_chunks=len(chunks), total_bytes=total)
    if arena.shared:
        manifest.shared_path = str(arena.path)
        for name, spec in arena.specs.items():
            manifest.shared.add(name=name, dtype=str(spec.dtype).removeprefix("torch."), shape=list(spec.shape),
                                byte_offset=arena.offsets[name])
    return manifest


class WeightPublisher:
    """`start()` binds a ROUTER on `host`; `endpoint` is what workers connect to (the trainer registers it)."""

    def __init__(self, host: str = "127.0.0.1", dtype: torch.dtype = torch.bfloat16, chunk_bytes: int = 4 << 20,
                 keep: int = 2, advertise: str = "", token: str | None = None):
        """`host`: the interface to bind; `advertise`: the host workers dial (net.advertised); `token`: the one every
        request must carry (None: FOLDMOE_AUTH_TOKEN)."""
        self.host, self.dtype, self.chunk_bytes, self.keep = host, dtype, chunk_bytes, keep
        self.advertise = net.advertised(host, advertise)
        self.token = net.auth_token() if token is None else token
        self._versions: OrderedDict[int, _Version] = OrderedDict()
        self._retired: list[_Version] = []  # dropped versions: their buffers are reused once their sends are done
        self._lock = threading.Condition()  # notified as `prepare` readies buffers
        self._preparing: threading.Thread | None = None
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self.endpoint = ""

    @classmethod
    def from_config(cls, rl, host: str = "127.0.0.1", advertise: str = "") -> "WeightPublisher":
        """From the `rl` config section (`weight_dtype`, `weight_chunk_mb`); `host`, `advertise`: `run.bind_host`,
        `run.advertise_host`."""
        return cls(host, dtype=sync_dtype(rl), chunk_bytes=int(rl.weight_chunk_mb * 2**20), advertise=advertise)

    def start(self) -> "WeightPublisher":
        remove_stale_files()  # buffers a crashed trainer left in shared memory
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{self.host}")
        self.endpoint = f"tcp://{self.advertise}:{port}"
        self._thread = threading.Thread(target=self._serve, name="weights-publisher", daemon=True)
        self._thread.start()
        return self

    @property
    def latest(self) -> int:
        with self._lock:
            return next(reversed(self._versions)) if self._versions else -1

    @torch.no_grad()
    def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Make `state` (full tensors, on any device) the newest weights. Versions must increase; the tensors are
        copied."""
        specs = {k: self.spec(v) for k, v in state.items()}
        with self.new_version(version, specs) as host:
            for k, v in state.items():
                host[k].copy_(v.detach().reshape(host[k].shape), non_blocking=True)

    def spec(self, t: torch.Tensor) -> TensorSpec:
        """How `t` travels: floating tensors in the sync dtype, others as they are."""
        return TensorSpec(tuple(t.shape), self.dtype if t.is_floating_point() else t.dtype)

    @contextmanager
    def new_version(self, version: int, specs: dict[str, TensorSpec]) -> Iterator[dict[str, torch.Tensor]]:
        """Host buffers for `version`'s tensors (`specs`: name -> shape and dtype, in the order workers load them),
        to be filled in the `with` block, by copies that may be non-blocking; on leaving it the device copies are
        waited for and the version is published. Versions must increase; an exception in the block publishes nothing."""
        if version <= self.latest:
            raise ValueError(f"weights version {version} is not newer than the published {self.latest}")
        arena = self._take_arena(specs)
        try:
            yield arena.views
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
        except BaseException:
            with self._lock:
                self._retired.append(_Version(arena, []))
            raise
        chunks = chunk_state(arena.views, self.chunk_bytes)
        published = _Version(arena, chunks, _manifest(version, arena, chunks))
        with self._lock:
            self._versions[version] = published
            while len(self._versions) > self.keep:
                self._retired.append(self._versions.popitem(last=False)[1])

    def prepare(self, specs: dict[str, TensorSpec]) -> None:
        """Allocate the buffers of the first `keep + 1` versions of `specs` in a background thread, so that no publish
        pays for page-locking them (about as long as the copy into them: ~1.9 s per 3.7 GB, bench/RESULTS.md) but the
        first, which waits for the first buffers ready. Where they do not fit a version, it allocates its own."""

        def allocate() -> None:
            try:
                for _ in range(self.keep + 1):
                    if self._stop.is_set():
                        return
                    arena = self._new_arena(specs)
                    with self._lock:
                        self._retired.append(_Version(arena, []))
                        self._lock.notify_all()
            except Exception as e:  # the publishes allocate what is missing
                log.warning("preparing weight buffers failed (%s); publishes allocate their own", e)

        self._preparing = threading.Thread(target=allocate, name="weights-prepare", daemon=True)
        self._preparing.start()

    def _take_arena(self, specs: dict[str, TensorSpec]) -> HostArena:
        """A retired (or prepared) version's buffers, if they fit `specs` and ZMQ has let go of them; else new ones."""
        with self._lock:
            while True:
                for old in self._retired:
                    if old.arena.matches(specs) and old.sent():
                        self._retired.remove(old)
                        return old.arena
                if self._preparing is None or not self._preparing.is_alive():
                    break
                self._lock.wait(0.1)  # buffers being prepared: waiting costs less than allocating more
        return self._new_arena(specs)

    @staticmethod
    def _new_arena(specs: dict[str, TensorSpec]) -> HostArena:
        return HostArena(specs, pin=torch.cuda.is_available(), tag="weights-", what="weights")

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            frames = self._sock.recv_multipart(copy=False)
            # The routing envelope (peer identity, REQ_CORRELATE's request id) ends at the first empty frame; it goes
            # back unchanged in front of the reply.
            split = next((i for i, f in enumerate(frames) if len(f.buffer) == 0), None)
            if split is None:
                continue  # not from a REQ socket: nothing we can answer
            source = None
            try:
                reply, source = self._answer(frames[split + 1:])
            except wire.Unauthenticated as e:
                reply = wire.encode("weights_error", pb.WeightsError(message=f"refused: {e}"))
            except wire.WireError as e:
                reply = wire.encode("weights_error", pb.WeightsError(message=f"malformed request: {e}"))
            if source is not None:  # tensor frames view the version's buffers: tracked until ZMQ lets go of them
                reply = [reply[0], *(zmq.Frame(f, track=True) for f in reply[1:])]
                tracker = zmq.MessageTracker(*reply[1:])
                with self._lock:
                    source.sends = [t for t in source.sends if not t.done] + [tracker]
            self._sock.send_multipart([*frames[:split + 1], *reply], copy=False)
            del reply  # the frames' last references here: ZMQ's own end the tracking

    def _answer(self, frames) -> tuple[list, _Version | None]:
        """The reply's frames, and the version whose buffers its tensor frames view (None: no tensors)."""
        kind, req, _ = wire.decode(frames, pb.WeightsRequest, token=self.token)
        with self._lock:
            if kind == "weights_latest":
                if not self._versions:
                    return wire.encode("weights_manifest", pb.WeightsManifest(version=-1)), None
                return wire.encode("weights_manifest", next(reversed(self._versions.values())).manifest), None
            if kind == "weights_held":
                held = self._versions.get(req.version)
                if held is None:
                    return wire.encode("weights_error", pb.WeightsError(
                        message=f"version {req.version} is no longer published", version_gone=True)), None
                return wire.encode("weights_manifest", held.manifest), None
            if kind == "weights_chunk":
                held = self._versions.get(req.version)
                if held is None:
                    return wire.encode("weights_error", pb.WeightsError(
                        message=f"version {req.version} is no longer published", version_gone=True)), None
                chunks = held.chunks
                if req.chunk >= len(chunks):
                    return wire.encode("weights_error", pb.WeightsError(
                        message=f"version {req.version} has {len(chunks)} chunks, asked for chunk {req.chunk}")), None
                pieces, tensors = chunks[req.chunk]
                body = pb.WeightsChunk(version=req.version, chunk=req.chunk, num_chunks=len(chunks), pieces=pieces)
                return wire.encode("weights_chunk", body, {str(i): t for i, t in enumerate(tensors)}), held
        return wire.encode("weights_error", pb.WeightsError(message=f"unknown request kind {kind!r}")), None

    def stop(self) -> None:
        self._stop.set()
        if self._preparing is not None:
            self._preparing.join()  # it may be page-locking a buffer: closed below with the rest
        if hasattr(self, "_thread"):
            self._thread.join(timeout=5)
            self._sock.close(linger=0)
        with self._lock:
            for held in [*self._versions.values(), *self._retired]:
                held.chunks = []
                held.arena.close()
            self._versions.clear()
            self._retired.clear()
