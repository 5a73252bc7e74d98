"""Worker side of policy weight sync: pull the trainer's newest weights between batches, within a staleness bound.

The trainer serves versioned weights (`services/trainer/rl/weight_publisher.py`; the exchange is the weight messages of
`proto/rollout.proto`) and registers the endpoint as service "rl_weights" {"zmq": endpoint}. `WeightReceiver` pulls one
chunk per request (memory bounded by a chunk); on the publisher's host, where the manifest names a shared-memory file
it can open, it reads the tensors from that file instead (no bytes over TCP), and `confirm` then asks whether the
version is still kept: the publisher reuses a version's buffers only after dropping it, so a kept version was read
whole, and a dropped one may have been overwritten mid-read (VersionGone: the weights loaded from it are not a
policy; pull again). `PolicyWeights` swaps the weights into the rollout model between batches
and enforces the staleness bound: it never lets the worker generate with weights more than `max_staleness` versions
behind the newest published, waiting for a newer version instead.

Versions count the trainer's optimizer steps, so they are only comparable within one trainer incarnation: a trainer
that restarts from a checkpoint publishes from that checkpoint's step again, on a new endpoint. `PolicyWeights` looks
the publisher up in the registry whenever the one it knows does not answer, and on a new endpoint forgets its version
(weights of a timeline the trainer abandoned are not a few versions behind: they are not the policy at all).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch
import zmq

from proto import rollout_pb2 as pb
from services.common import logs, net, wire
from services.common.host_memory import SHM_PREFIX, SharedFile, shm_dir

log = logs.logger("rollout")


class WeightSyncError(RuntimeError):
    """The publisher did not answer, or answered something that is not the weights asked for."""


class VersionGone(WeightSyncError):
    """The version being pulled was superseded before all its chunks arrived."""


class SyncStopped(WeightSyncError):
    """The worker is stopping; the request was abandoned."""


class WeightReceiver:
    """Pulls manifests and chunks from one publisher endpoint. A set `stop` event abandons a wait within 0.1 s."""

    def __init__(self, endpoint: str, timeout_s: float = 30.0, stop: threading.Event | None = None,
                 token: str | None = None, pin: bool = False):
        """`token`: the publisher's auth token (None: FOLDMOE_AUTH_TOKEN, see services/common/net.py). `pin`: register
        the publisher's shared files with CUDA as they are mapped (the weights load into a CUDA model: copies from a
        registered file run ~4x faster than from pageable memory, bench/RESULTS.md)."""
        self.endpoint, self.timeout_s, self.stop, self.pin = endpoint, timeout_s, stop, pin
        self.token = net.auth_token() if token is None else token
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.REQ)
        # A lost reply (publisher restarted) must not wedge the REQ state machine: allow re-sending after a timeout.
        self._sock.setsockopt(zmq.REQ_RELAXED, 1)
        self._sock.setsockopt(zmq.REQ_CORRELATE, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._maps: OrderedDict[str, SharedFile] = OrderedDict()  # the publisher's files we mapped, newest last
        self.shared_reads = 0  # versions read from the publisher's shared-memory files (the rest came in chunks)

    def _ask(self, kind: str, req: pb.WeightsRequest, reply_type):
        wire.send(self._sock, kind, req, token=self.token)
        # Short polls rather than one blocking receive: a worker told to stop must not sit out the whole timeout.
        deadline = time.monotonic() + self.timeout_s
        while not self._sock.poll(100, zmq.POLLIN):
            if self.stop is not None and self.stop.is_set():
                raise SyncStopped("stopping")
            if time.monotonic() > deadline:
                raise WeightSyncError(f"the weight publisher at {self.endpoint} did not answer within "
                                      f"{self.timeout_s:.0f}s; is the trainer running?")
        frames = self._sock.recv_multipart(copy=False)
        # Tensors as views of the frames (copy=False): `fetch` copies each piece once, into its place. (Decoded with a
        # copy, a chunk was copied three times; bench/RESULTS.md.)
        got, _, _ = wire.decode(frames, copy=False)
        if got == "weights_error":
            _, err, _ = wire.decode(frames, pb.WeightsError, copy=False)
            raise (VersionGone if err.version_gone else WeightSyncError)(f"weight publisher: {err.message}")
        return wire.decode(frames, reply_type, copy=False)

    def latest(self) -> pb.WeightsManifest:
        _, manifest, _ = self._ask("weights_latest", pb.WeightsRequest(), pb.WeightsManifest)
        return manifest

    def fetch(self, manifest: pb.WeightsManifest) -> dict[str, torch.Tensor]:
        """The tensors of the version in `manifest`: views of the publisher's shared-memory file where we can open it
        (read-only, valid until `confirm` says otherwise), else all chunks reassembled (raises VersionGone if
        superseded)."""
        shared = self._open_shared(manifest.shared_path) if manifest.shared_path else None
        if shared is None:
            return self._fetch_chunks(manifest)
        out = {}
        with warnings.catch_warnings():  # torch warns that the read-only mapping is not writable: we only read it
            warnings.simplefilter("ignore", UserWarning)
            for t in manifest.shared:
                dtype, data = shared.bytes_of(t.name, t.dtype, t.shape, t.byte_offset)
                out[t.name] = (torch.frombuffer(data, dtype=dtype) if len(data) else torch.empty(0, dtype=dtype)
                               ).view(list(t.shape))
        self.shared_reads += 1
        return out

    def confirm(self, manifest: pb.WeightsManifest) -> None:
        """After reading what `fetch` returned: raises VersionGone if it came from shared memory that the publisher
        may have reused during the read (the version was dropped); chunks were checked as they came."""
        if manifest.shared_path and manifest.shared_path in self._maps:
            self._ask("weights_held", pb.WeightsRequest(version=manifest.version), pb.WeightsManifest)

    def _open_shared(self, path: str) -> SharedFile | None:
        """A read-only mapping of the publisher's file `path`, kept for the next versions (the publisher cycles
        through a few files); None where we cannot open it (another host or container) or it is not such a file."""
        if path in self._maps:
            self._maps.move_to_end(path)
            return self._maps[path]
        p = Path(path)
        try:
            if not p.name.startswith(SHM_PREFIX) or not p.parent.samefile(shm_dir()):
                return None
            shared = SharedFile(path)
        except (OSError, ValueError):
            return None
        if self.pin:
            shared.pin()  # once per file: the publisher cycles through the same few
        self._maps[path] = shared
        while len(self._maps) > 4:  # the publisher keeps a few versions' files; older ones are gone
            self._maps.popitem(last=False)[1].close()
        return shared

    def _fetch_chunks(self, manifest: pb.WeightsManifest) -> dict[str, torch.Tensor]:
        flats: dict[str, torch.Tensor] = {}
        shapes: dict[str, list[int]] = {}
        for i in range(manifest.num_chunks):
            _, chunk, tensors = self._ask("weights_chunk", pb.WeightsRequest(version=manifest.version, chunk=i),
                                          pb.WeightsChunk)
            for j, piece in enumerate(chunk.pieces):
                part = tensors[str(j)]
                if piece.name not in flats:
                    shapes[piece.name] = list(piece.shape)
                    flats[piece.name] = torch.empty(int(torch.Size(piece.shape).numel()), dtype=part.dtype)
                flats[piece.name][piece.offset:piece.offset + piece.numel] = part
        return {name: flat.view(shapes[name]) for name, flat in flats.items()}

    def close(self) -> None:
        self._sock.close(linger=0)
        for shared in self._maps.values():
            shared.close()
        self._maps.clear()


class PolicyWeights:
    """The rollout model's weights and the version they are. Call `refresh()` between batches.

    `receiver`: a fixed publisher; or `locate`: returns the current publisher's endpoint (None while there is none),
    asked before every refresh so that a new trainer is followed.
    """

    def __init__(self, model: torch.nn.Module, receiver: WeightReceiver | None, max_staleness: int,
                 poll_s: float = 0.2, locate: Callable[[], str | None] | None = None,
                 stop: threading.Event | None = None, timeout_s: float = 30.0):
        if receiver is None and locate is None:
            raise ValueError("PolicyWeights needs a receiver or a way to locate the publisher")
        self.model, self.receiver, self.locate = model, receiver, locate
        self.max_staleness, self.poll_s, self.stop, self.timeout_s = max_staleness, poll_s, stop, timeout_s
        self.version = -1
        self.latest_seen = -1

    def behind(self) -> int:
        return self.latest_seen - self.version

    def _follow_publisher(self) -> None:
        endpoint = self.locate() if self.locate is not None else None
        if not endpoint or (self.receiver is not None and endpoint == self.receiver.endpoint):
            return
        if self.receiver is not None:
            log.info("the weight publisher moved to %s (a new trainer): version %d is no longer the policy",
                     endpoint, self.version)
            self.receiver.close()
        on_cuda = any(p.is_cuda for p in self.model.parameters())
        self.receiver = WeightReceiver(endpoint, self.timeout_s, self.stop, pin=on_cuda)
        self.version = self.latest_seen = -1

    def _stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def refresh(self, timeout_s: float | None = None) -> bool:
        """Load the newest published weights if they are newer than ours.

        Returns once our weights are at most `max_staleness` versions behind the newest seen. A worker that cannot get
        newer weights (the publisher is unreachable, or supersedes versions faster than they can be pulled) keeps
        generating while within the bound and waits, retrying, once beyond it. Returns False only when `stop` is set or
        `timeout_s` passes before the bound is met.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        waiting_logged = False
        while True:
            self._follow_publisher()
            try:
                if self.receiver is not None:
                    manifest = self.receiver.latest()
                    self.latest_seen = max(self.latest_seen, manifest.version)
                    if manifest.version > self.version:
                        self.model.load_state_dict(self.receiver.fetch(manifest))
                        try:
                            self.receiver.confirm(manifest)
                        except VersionGone:
                            self.version = -1  # what was loaded may be torn: no policy until a whole version is
                            raise
                        self.version = manifest.version
                        log.info("loaded weights version %d (%.1f MB)", self.version, manifest.total_bytes / 1e6)
            except VersionGone:
                continue  # superseded mid-pull: pull the newer one now
            except SyncStopped:
                return False
            except WeightSyncError as e:
                log.warning("weights not refreshed (version %d, newest seen %d): %s", self.version, self.latest_seen, e)
            if self.version >= 0 and self.behind() <= self.max_staleness:
                return True
            if self._stopped() or (deadline is not None and time.monotonic() > deadline):
                return False
            if not waiting_logged and self.version < 0:
                log.info("waiting for the trainer's first weights (registry service 'rl_weights')")
                waiting_logged = True
            if self.stop is not None:
                self.stop.wait(self.poll_s)
            else:
                time.sleep(self.poll_s)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
