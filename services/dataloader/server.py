"""The dataloader service: streams micro-batches to trainer ranks over ZMQ, answers control calls over gRPC.

    python -m services.dataloader.server --config FILE [section.key=value ...]

ZMQ (ROUTER): clients send `hello` then `credit` messages; the server answers with `micro_batch` messages (a
`MicroBatchHeader` plus tensor frames, see proto/dataloader.proto) within each client's credits, or one `error`. An
`eval` message asks for a rank's share of the held-out evaluation set (heldout.py), answered at once with `eval_batch`
messages.
gRPC: `foldmoe.v1.DataLoader` (Status, GetState, ResumeFromState) and `grpc.health.v1.Health`.
HTTP: Prometheus metrics at `/metrics` (see `metrics.py`).
Registers as service "dataloader" with {"zmq": ..., "grpc": ..., "metrics": ..., "replica": r, "replicas": n} under run
`run.name`. With `data.replicas` = n > 1, each service claims the lowest free replica index in the registry (so n
identical commands, from the launcher or `docker compose --scale`, make up the n replicas) and serves the dp ranks with
dp_rank % n == r (see `engine.py`). Endpoints bind `run.bind_host`; with FOLDMOE_AUTH_TOKEN set, requests must carry it
(services/common/net.py).

A restarted service (after a crash) starts empty and registers new endpoints; the trainer's `DataClient`s find it in
the registry and resume it from their last fully received step (see `client.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading

import grpc
import zmq

from proto import dataloader_pb2 as pb
from proto import dataloader_pb2_grpc as pb_grpc
from services.common import grpc_server, logs, net, procs, wire
from services.common.registry import Registry, redis_url
from services.dataloader.cp_sizing import allowed_cp_sizes
from services.dataloader.dataset import IndexedDataset
from services.dataloader.engine import Engine
from services.dataloader.errors import DataError
from services.dataloader.metrics import MetricsServer
from services.dataloader.preprocess import dataset_paths, ensure_dataset, eval_dataset_path, open_tokenizer

log = logs.logger("dataloader")
SERVICE_NAME = "foldmoe.v1.DataLoader"
POLL_MS = 50


class _Control(pb_grpc.DataLoaderServicer):
    def __init__(self, engine: Engine):
        self.engine = engine

    def Status(self, request, context):
        with self.engine.lock:
            return self.engine.status()

    def GetState(self, request, context):
        try:
            with self.engine.lock:
                state = self.engine.get_state(request.step if request.HasField("step") else None)
        except DataError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return pb.DataStreamState(json=json.dumps(state))

    def ResumeFromState(self, request, context):
        try:
            with self.engine.lock:
                step, moved = self.engine.resume(request.state_json, request.dp_size)
        except DataError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        log.info("rank %d resumed at step %d (%s)", request.rank, step, "stream moved" if moved else "already there")
        return pb.DataResumeReply(start_step=step, reset=moved)


class DataLoaderServer:
    """One service instance; `start()` binds and serves in a background thread, `stop()` tears everything down."""

    def __init__(self, cfg, registry: Registry | None = None, replica: int = 0, token: str | None = None):
        """`replica`: this service's index among `data.replicas` when there is no `registry` (with one, it claims
        a free index there at `start`). `token`: the auth token (None: FOLDMOE_AUTH_TOKEN)."""
        self.cfg, self.registry = cfg, registry
        self.host, self.advertise = cfg.run.bind_host, net.advertised(cfg.run.bind_host, cfg.run.advertise_host)
        self.token = net.auth_token() if token is None else token
        cp_sizes = allowed_cp_sizes(cfg.parallel)
        if cfg.rl.enabled:  # the rollout stream, not a corpus (rollout_source.py)
            self.datasets = []
            self.engine = Engine([], cfg.data, cp_sizes, make_stream=self._rollout_streams(cfg, cp_sizes),
                                 replica=replica)
        else:
            ensure_dataset(cfg)
            tokenizer = open_tokenizer(cfg.data.tokenizer)
            self.datasets = [IndexedDataset(p, expect_tokenizer=tokenizer.identity()) for p in dataset_paths(cfg)]
            path = eval_dataset_path(cfg)
            eval_datasets = [IndexedDataset(path, expect_tokenizer=tokenizer.identity())] if path else None
            for dataset in self.datasets + (eval_datasets or []):
                if over := dataset.examples_over(cfg.data.seq_len):
                    log.warning("%s: %d prompt/completion examples are longer than data.seq_len=%d positions; each "
                                "is cut to its first %d (the rest is not trained on): raise data.seq_len or shorten "
                                "them", dataset.path, over, cfg.data.seq_len, cfg.data.seq_len)
            self.engine = Engine(self.datasets, cfg.data, cp_sizes, replica=replica, eval_datasets=eval_datasets)
        self._ctx = zmq.Context.instance()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._heartbeat = None
        self.error: BaseException | None = None

    def _rollout_streams(self, cfg, cp_sizes):
        from services.dataloader.rollout_source import RolloutStepStream, TrajectoryLog

        if not cfg.data.rollout_stream and self.registry is None:
            raise DataError("an RL run's dataloader (`rl.enabled`) needs `data.rollout_stream` or a registry to find "
                            "the workers' stream")
        url = self.registry.url if self.registry is not None else redis_url()
        log_ = TrajectoryLog(url, cfg.data.rollout_stream, self.registry)
        return lambda dp_size: RolloutStepStream(log_, cfg, dp_size, cp_sizes)

    def start(self) -> "DataLoaderServer":
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        port = self._router.bind_to_random_port(f"tcp://{self.host}")
        self.zmq_endpoint = f"tcp://{self.advertise}:{port}"
        self._grpc, port = grpc_server.serve(
            [lambda s: pb_grpc.add_DataLoaderServicer_to_server(_Control(self.engine), s)], [SERVICE_NAME],
            host=self.host, max_workers=4, token=self.token)
        self.grpc_endpoint = f"{self.advertise}:{port}"
        self._metrics = MetricsServer(self.engine, self.host, self.advertise)
        self.metrics_endpoint = self._metrics.endpoint
        self._thread = threading.Thread(target=self._serve, name="dataloader-zmq", daemon=True)
        self._thread.start()
        if self.registry is not None:
            self._register()
        what = (f"{', '.join(str(d.path) for d in self.datasets)} ({sum(len(d) for d in self.datasets)} documents)"
                if self.datasets else "RL trajectories from the rollout stream")
        log.info("replica %d of %d serving %s on zmq %s, grpc %s, metrics %s", self.engine.replica, self.engine.replicas,
                 what, self.zmq_endpoint, self.grpc_endpoint, self.metrics_endpoint)
        return self

    def _register(self) -> None:
        info = {"zmq": self.zmq_endpoint, "grpc": self.grpc_endpoint, "metrics": self.metrics_endpoint}
        replicas = self.engine.replicas
        if replicas == 1:
            self._heartbeat = self.registry.register("dataloader", {**info, "replica": 0, "replicas": 1})
            return
        # The engine lock is held from before the record appears until the engine knows its replica, so no client
        # that finds the record is served (or refused) under another index.
        with self.engine.lock:
            self.engine.replica, self._heartbeat = self.registry.claim("dataloader", replicas, info)

    @property
    def replica(self) -> int:
        """This service's replica index (the engine's: claimed in the registry at `start`)."""
        return self.engine.replica

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(POLL_MS):
                    self._drain()
                with self.engine.lock:
                    outgoing = self.engine.pending()
                for ident, header, tensors in outgoing:
                    self._router.send_multipart([ident, *wire.encode("micro_batch", header, tensors)], copy=False)
        except BaseException as e:  # surfaced by wait(): a dead serving thread must not look like a live service
            self.error = e
            log.exception("dataloader serving loop failed")
            self._stop.set()

    def _drain(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = frames[0].bytes
            try:
                kind, _, _ = wire.decode(frames[1:], token=self.token)
                if kind == "hello":
                    _, msg, _ = wire.decode(frames[1:], pb.DataHello)
                    with self.engine.lock:
                        problem = self.engine.hello(ident, msg)
                    if problem:
                        self._reply_error(ident, problem)
                elif kind == "eval":
                    _, msg, _ = wire.decode(frames[1:], pb.DataEvalRequest)
                    try:
                        with self.engine.lock:
                            share = self.engine.eval_share(msg.dp_rank, msg.dp_size)
                    except DataError as e:
                        self._reply_error(ident, str(e))
                    else:
                        for header, tensors in share:
                            self._router.send_multipart([ident, *wire.encode("eval_batch", header, tensors)],
                                                        copy=False)
                elif kind == "credit":
                    _, msg, _ = wire.decode(frames[1:], pb.DataCredit)
                    with self.engine.lock:
                        rank = self.engine.client_rank(ident)
                        if rank is None:
                            self._reply_error(ident, "credit from a client that never said hello; reconnect")
                        else:
                            self.engine.credit(rank, msg.credits)
                else:
                    self._reply_error(ident, f"unknown message kind {kind!r}")
            except wire.Unauthenticated as e:
                self._reply_error(ident, f"refused: {e}")
            except wire.WireError as e:
                self._reply_error(ident, f"malformed message: {e}")

    def _reply_error(self, ident: bytes, message: str) -> None:
        log.warning("client error: %s", message)
        self._router.send_multipart([ident, *wire.encode("error", pb.DataErrorReply(message=message))])

    def wait(self, timeout: float | None = None) -> bool:
        """Block until stopped (or `timeout`); True if stopped."""
        return self._stop.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)
        grpc_server.stop(self._grpc, grace=0.5)
        self._metrics.stop()
        self._router.close(linger=0)


def main(argv: list[str] | None = None) -> int:
    from services.common.config import load_config
    from services.common.registry import RegistryError

    parser = argparse.ArgumentParser(prog="python -m services.dataloader.server", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args(argv)
    logs.configure("dataloader")
    stop = threading.Event()
    try:
        procs.stop_on_signals(stop)  # first: a malformed stop grace fails before anything is started
        cfg = load_config(args.config, args.overrides)
        server = DataLoaderServer(cfg, Registry(redis_url(), cfg.run.name)).start()
    except (ValueError, DataError, RegistryError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    while not (stop.wait(0.5) or server.wait(0)):  # a signal, or the server stopping by itself
        pass
    server.stop()
    if server.error is not None:
        print(f"error: dataloader serving loop failed: {server.error!r}", file=sys.stderr)
        return 1
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
