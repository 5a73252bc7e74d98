"""What a trainer rank uses to pull its micro-batches from the dataloader service.

    client = DataClient.from_registry(registry, dp_rank, dp_size, cfg)
    client.resume(checkpoint["data"])          # optional; without it the stream starts at step 0
    micro_batches = client.next_step()         # data.grad_accum dicts of CPU tensors
    held_out = client.eval_micro_batches()     # this rank's share of the evaluation set (data.eval_fraction)
    checkpoint["data"] = client.state()        # JSON-able; resuming from it replays nothing and skips nothing

Each micro-batch dict holds tokens, labels, position_ids (int64[T]), cu_seqlens (int32[S+1]) and cp_size (an int64
0-dim tensor: the context-parallel size the dataloader sized this micro-batch for, see `stream.py`); in an RL run also the
tensors of `rollout_source.py` (loss_mask, rollout_logprobs, advantages, rewards, versions, routing_ids, temperature).

Surviving a restart of the service: while waiting for a micro-batch the client checks every `LIVENESS_S` that the
service still answers gRPC. When it does not (killed, host gone), the client looks the service up in the run's registry
again (a restarted one registers new endpoints; the dead one's record lingers until its TTL, so every record is tried,
newest first), resumes it from the state after the last step this rank received in full, and receives that step's
micro-batches again; a partly received step is discarded. The stream of steps `next_step` returns is therefore the
same as without the restart. Without a registry (`DataClient(...)` built from endpoints) only the same endpoints are
retried.

On demand (`on_demand=True`; `from_registry` picks it in an RL run, `rl.enabled`): the client holds no credits between
steps, so the service builds step s only once the trainer calls `next_step` for it (an RL step must not be packed
before the weights that train it exist, see rollout_source.py); it asks for one micro-batch, learns the step's count
from its header (an RL step's count depends on its trajectories) and then asks for the rest. `grad_accum` is unused.

Replicas (`data.replicas` = n): the client uses replica dp_rank % n, before and after a restart; the others never see
it. Auth: with FOLDMOE_AUTH_TOKEN set, every gRPC call and ZMQ message carries it (services/common/net.py).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any, Callable

import grpc
import torch
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import dataloader_pb2 as pb
from proto import dataloader_pb2_grpc as pb_grpc
from services.common import net, wire
from services.common.registry import Registry, RegistryError
from services.dataloader.errors import DataError

CONNECT_TIMEOUT_S = 10.0
LIVENESS_S = 1.0  # how often a waiting client checks that the service is still there
HEALTH_TIMEOUT_S = 2.0
SERVICE_NAME = "foldmoe.v1.DataLoader"


class _ServiceLost(Exception):
    """The service stopped answering while this client waited for a micro-batch."""


class DataClient:
    def __init__(self, zmq_endpoint: str, grpc_endpoint: str, *, dp_rank: int, dp_size: int, grad_accum: int,
                 rank: int | None = None, group_size: int = 1, prefetch: int = 8, timeout: float = 60.0,
                 registry: Registry | None = None, replicas: int = 1, token: str | None = None,
                 on_demand: bool = False):
        """`timeout`: longest wait for one micro-batch from a live service, and for a lost service to come back.
        `registry`: where to find the service again after it restarts (None: retry the same endpoints); `replicas`:
        the run's `data.replicas` (which registered replica is this rank's). `token`: None: FOLDMOE_AUTH_TOKEN."""
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        self.replica = dp_rank % replicas
        self.token = net.auth_token() if token is None else token
        self._metadata = net.call_metadata(self.token)
        self.zmq_endpoint, self.grpc_endpoint = zmq_endpoint, grpc_endpoint
        self.dp_rank, self.dp_size, self.grad_accum = dp_rank, dp_size, grad_accum
        self.rank = dp_rank if rank is None else rank
        self.group_size, self.prefetch, self.timeout = group_size, max(1, prefetch), timeout
        self.registry, self.on_demand = registry, on_demand
        self.reconnects = 0
        self._connect_control(grpc_endpoint)
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._state: dict[str, Any] = {}  # empty: the start of the stream
        self._next_step = 0

    @classmethod
    def from_registry(cls, registry: Registry, dp_rank: int, dp_size: int, cfg, *, rank: int | None = None,
                      world_size: int | None = None, timeout: float = 60.0) -> "DataClient":
        """Find the service in the run's registry; `rank`/`world_size` default to the torch.distributed ones."""
        if rank is None or world_size is None:
            dist = torch.distributed
            live = dist.is_available() and dist.is_initialized()
            rank = rank if rank is not None else (dist.get_rank() if live else int(os.environ.get("RANK", dp_rank)))
            world_size = world_size or (dist.get_world_size() if live else int(os.environ.get("WORLD_SIZE", dp_size)))
        if world_size % dp_size:
            raise DataError(f"world size {world_size} is not a multiple of dp_size={dp_size}")
        replicas, replica = cfg.data.replicas, dp_rank % cfg.data.replicas
        try:
            record = _newest(registry.wait_for("dataloader", 1, timeout=timeout, where=lambda r: _serves(r, replica)))
        except RegistryError as e:
            raise RegistryError(f"no dataloader replica {replica} (data.replicas={replicas}; it serves dp_rank "
                                f"{dp_rank}) is registered: {e}") from None
        return cls(record["zmq"], record["grpc"], dp_rank=dp_rank, dp_size=dp_size, grad_accum=cfg.data.grad_accum,
                   rank=rank, group_size=world_size // dp_size, prefetch=cfg.data.prefetch, timeout=timeout,
                   registry=registry, replicas=replicas, on_demand=cfg.rl.enabled)

    # ------------------------------------------------------------ control

    def _connect_control(self, grpc_endpoint: str) -> None:
        self.grpc_endpoint = grpc_endpoint
        self._channel = grpc.insecure_channel(grpc_endpoint)
        self._control = pb_grpc.DataLoaderStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _call(self, method, request, what: str):
        try:
            return method(request, timeout=CONNECT_TIMEOUT_S, metadata=self._metadata)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise DataError(f"dataloader gRPC endpoint {self.grpc_endpoint} unreachable during {what} "
                                f"({e.code().name}); is the dataloader service running?") from None
            raise DataError(f"dataloader refused {what}: {e.details()}") from None

    def resume(self, state: dict[str, Any] | None) -> int:
        """Restart this rank's stream at `state` (from `state()`; None or {}: the start). Returns the step."""
        reply = self._call(self._control.ResumeFromState,
                           pb.DataResumeRequest(state_json=json.dumps(state) if state else "", dp_size=self.dp_size,
                                                rank=self.rank), "ResumeFromState")
        self._state = dict(state or {})
        self._next_step = reply.start_step
        self._join()
        return reply.start_step

    def _join(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)  # micro-batches in flight from before the resume are discarded with it
        self._sock = self._dealer(f"rank{self.rank}-{uuid.uuid4().hex[:8]}".encode())
        wire.send(self._sock, "hello", pb.DataHello(rank=self.rank, dp_rank=self.dp_rank, dp_size=self.dp_size,
                                                    group_size=self.group_size, start_step=self._next_step,
                                                    credits=0 if self.on_demand else self.prefetch), token=self.token)

    def _dealer(self, identity: bytes | None = None) -> zmq.Socket:
        """A DEALER socket connected to the service, dropping unsent messages when closed."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            sock.setsockopt(zmq.ROUTING_ID, identity)
        sock.connect(self.zmq_endpoint)
        return sock

    def status(self) -> dict[str, Any]:
        reply = self._call(self._control.Status, pb.DataStatusRequest(), "Status")
        return {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}

    def state(self) -> dict[str, Any]:
        """The stream position after the last step returned by `next_step` (JSON-able)."""
        return dict(self._state)

    @property
    def step(self) -> int:
        """The step `next_step` returns next."""
        return self._next_step

    # ------------------------------------------------------------ data

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """The `grad_accum` micro-batches of this rank's next optimizer step."""
        if self._sock is None:
            self.resume(self._state)
        return self._across_restarts(self._receive_step)

    def _receive_step(self) -> list[dict[str, torch.Tensor]]:
        out, state_after = [], None
        count, micro = self.grad_accum, 0
        if self.on_demand:
            self._grant(1)
        while micro < count:
            header, tensors = self._recv(self._sock, "micro_batch", f"step {self._next_step}")
            if not self.on_demand:
                self._grant(1)
            if header.step != self._next_step or header.micro != micro:
                raise DataError(f"dataloader sent step {header.step} micro-batch {header.micro}, expected step "
                                f"{self._next_step} micro-batch {micro}: another rank resumed the stream elsewhere; "
                                "all ranks must resume from the same state")
            if self.on_demand:
                if micro == 0:
                    count = header.grad_accum
                    if count > 1:
                        self._grant(count - 1)
            elif header.grad_accum != self.grad_accum:
                raise DataError(f"dataloader serves grad_accum={header.grad_accum} but this trainer uses "
                                f"{self.grad_accum}; start both from the same config")
            tensors["cp_size"] = torch.tensor(header.cp_size or 1, dtype=torch.int64)
            out.append(tensors)
            state_after = header.state_after
            micro += 1
        self._state = json.loads(state_after)
        self._next_step += 1
        return out

    def _recv(self, sock: zmq.Socket, expect: str, waiting_for: str
              ) -> tuple[pb.MicroBatchHeader, dict[str, torch.Tensor]]:
        """The next message on `sock`, a micro-batch of kind `expect` ("micro_batch" or "eval_batch")."""
        deadline = time.monotonic() + self.timeout
        while not sock.poll(int(LIVENESS_S * 1000)):
            if not self._alive():
                raise _ServiceLost()
            if time.monotonic() > deadline:
                raise DataError(f"no micro-batch from the dataloader at {self.zmq_endpoint} within "
                                f"{self.timeout:.0f}s (waiting for {waiting_for}) although it answers gRPC "
                                f"at {self.grpc_endpoint}; see its log for what holds it up"
                                + (" (an RL step waits for fresh trajectory groups: are the rollout workers running?)"
                                   if self.on_demand else ""))
        kind, _, _ = wire.decode(frames := sock.recv_multipart(copy=False))
        if kind == "error":
            _, err, _ = wire.decode(frames, pb.DataErrorReply)
            raise DataError(f"dataloader at {self.zmq_endpoint}: {err.message}")
        if kind != expect:
            raise DataError(f"dataloader sent an unexpected {kind!r} message")
        _, header, tensors = wire.decode(frames, pb.MicroBatchHeader)
        return header, tensors

    # ------------------------------------------------------------ evaluation

    def eval_micro_batches(self) -> list[dict[str, torch.Tensor]]:
        """This rank's share of the run's held-out evaluation set (services/dataloader/heldout.py: the same
        micro-batches at every call), as `next_step`'s dicts. Asked for on a socket of its own, so the training
        stream's prefetched micro-batches stay where they are; a service lost meanwhile is found again as `next_step`
        finds it."""
        return self._across_restarts(self._receive_eval)

    def _receive_eval(self) -> list[dict[str, torch.Tensor]]:
        sock = self._dealer()
        try:
            wire.send(sock, "eval", pb.DataEvalRequest(dp_rank=self.dp_rank, dp_size=self.dp_size), token=self.token)
            out, count = [], 1
            while len(out) < count:
                header, tensors = self._recv(sock, "eval_batch", "the evaluation set")
                if header.micro != len(out):
                    raise DataError(f"dataloader sent evaluation micro-batch {header.micro}, expected {len(out)}")
                count = header.grad_accum
                tensors["cp_size"] = torch.tensor(header.cp_size or 1, dtype=torch.int64)
                out.append(tensors)
            return out
        finally:
            sock.close(linger=0)

    def _grant(self, credits: int) -> None:
        wire.send(self._sock, "credit", pb.DataCredit(credits=credits), token=self.token)

    # ------------------------------------------------------------ surviving a restart of the service

    def _across_restarts(self, receive: Callable[[], Any]) -> Any:
        """`receive()`, again after each reconnection while the service is lost meanwhile."""
        while True:
            try:
                return receive()
            except _ServiceLost:
                self._reconnect()

    def _alive(self) -> bool:
        """The service's gRPC health says SERVING. (Health, not Status: it does not wait for the engine's lock, so a
        service busy packing a large step still answers at once.)"""
        try:
            reply = self._health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=HEALTH_TIMEOUT_S)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def _candidates(self) -> list[tuple[str, str]]:
        """(zmq, grpc) endpoints of this rank's replica to try, newest registration first; the current ones when there
        is no registry."""
        if self.registry is None:
            return [(self.zmq_endpoint, self.grpc_endpoint)]
        records = sorted((r for r in self.registry.lookup("dataloader") if _serves(r, self.replica)),
                         key=lambda r: -float(r.get("started", 0)))
        return [(r["zmq"], r["grpc"]) for r in records]

    def _reconnect(self) -> None:
        """Find a live service and resume it from the last fully received step; DataError after `timeout`."""
        lost = self.grpc_endpoint
        self._drop_connection()
        deadline = time.monotonic() + self.timeout
        while True:
            for zmq_endpoint, grpc_endpoint in self._candidates():
                self.zmq_endpoint = zmq_endpoint
                self._connect_control(grpc_endpoint)
                if self._alive():
                    try:
                        self.resume(self._state)
                    except DataError:
                        if self._alive():
                            raise  # a live service refused the state: retrying cannot help
                    else:
                        self.reconnects += 1
                        return
                self._drop_connection()
            if time.monotonic() > deadline:
                where = f"registry run {self.registry.run!r}" if self.registry else "the same endpoints"
                raise DataError(f"the dataloader at {lost} stopped answering and none came back within "
                                f"{self.timeout:.0f}s ({where}); restart the dataloader service")
            time.sleep(0.2)

    def _drop_connection(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)  # micro-batches of a partly received step go with it
            self._sock = None
        self._channel.close()

    def close(self) -> None:
        self._drop_connection()

    def __enter__(self) -> "DataClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serves(record: dict[str, Any], replica: int) -> bool:
    return int(record.get("replica", 0)) == replica


def _newest(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The most recent registration: a crashed instance's record outlives it by up to the heartbeat TTL."""
    return max(records, key=lambda r: float(r.get("started", 0)))
