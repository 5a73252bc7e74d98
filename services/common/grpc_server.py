"""The gRPC plumbing every service shares: a server on a free port with the standard health service (and, with a token,
the auth interceptor of services/common/net.py), and a client-side wait for a peer to report SERVING.

Health is the stock `grpc.health.v1` protocol so that generic probes (compose health checks, grpc_health_probe) work
against every foldmoe service without knowing its API.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common import net

# Registers servicers on the server, e.g. `lambda s: foo_pb2_grpc.add_FooServicer_to_server(FooImpl(), s)`.
AddServicer = Callable[[grpc.Server], None]


class GrpcUnavailable(RuntimeError):
    """A gRPC peer that did not become healthy in time."""


def serve(add_servicers: Iterable[AddServicer] = (), service_names: Iterable[str] = (), host: str = "127.0.0.1",
          port: int = 0, max_workers: int = 8, token: str = "") -> tuple[grpc.Server, int]:
    """Start a server with the health service; every name in `service_names` (and "" = the whole server) is SERVING.
    `token`: calls other than health must carry it (services/common/net.py); "": no authentication.

    Returns the started server and the port it bound (a free one when `port` is 0).
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
                         interceptors=net.server_interceptors(token))
    for add in add_servicers:
        add(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise GrpcUnavailable(f"cannot bind a gRPC server to {host}:{port}; pick another port or leave it 0")
    server.start()
    for name in ("", *service_names):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound


def stop(server: grpc.Server, grace: float) -> None:
    """Stop `server`, letting calls in flight finish for up to `grace` seconds, and return only once it has stopped.
    A process that exits with gRPC still shutting down can hang: a call arriving after the interpreter has shut its
    thread pools kills gRPC's serving thread ("cannot schedule new futures after shutdown"), and the exit never ends
    (tests/test_checkpointer_service.py)."""
    server.stop(grace=grace).wait()


def check(address: str, service: str = "", timeout: float = 1.0) -> bool:
    """One health probe: True when `address` answers SERVING for `service`."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def wait_healthy(address: str, timeout: float = 30.0, service: str = "") -> None:
    """Block until `address` reports SERVING; raise `GrpcUnavailable` naming the address after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if check(address, service, timeout=max(0.1, min(1.0, remaining))):
            return
        if time.monotonic() >= deadline:
            what = f"service {service!r} at {address}" if service else address
            raise GrpcUnavailable(f"gRPC {what} did not report SERVING within {timeout:.0f}s; "
                                  "is the service running, and is this its registered address?")
        time.sleep(0.1)


def probe_registered(url: str, run: str, service: str, timeout: float = 2.0) -> str:
    """Health of every registered instance of `service`; returns "" when all are SERVING, else what is wrong."""
    from services.common.registry import Registry, RegistryError

    try:
        records = Registry(url, run).lookup(service)
    except RegistryError as e:
        return str(e)
    if not records:
        return f"no {service!r} registered in run {run!r} at {url}"
    sick = [r.get("grpc") or "(no grpc address)" for r in records
            if not r.get("grpc") or not check(r["grpc"], "", timeout)]
    return f"{service} at {', '.join(sick)} is not SERVING" if sick else ""


def main(argv: list[str] | None = None) -> int:
    """Container health check: `python -m services.common.grpc_server --config FILE SERVICE [section.key=value ...]`."""
    import argparse
    import sys

    from services.common.config import ConfigError, load_config
    from services.common.registry import RegistryError, redis_url

    parser = argparse.ArgumentParser(prog="python -m services.common.grpc_server", description=main.__doc__)
    parser.add_argument("--config", default=None)
    parser.add_argument("service")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        problem = probe_registered(cfg.run.redis_url or redis_url(), cfg.run.name, args.service)
    except (ConfigError, RegistryError) as e:
        problem = str(e)
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
