"""A gRPC server bound to a free local port, with the standard `grpc.health.v1` health service attached."""

from __future__ import annotations

from concurrent import futures
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


class GrpcServer:
    """`add` callbacks register servicers (the generated `add_XServicer_to_server` functions, partially applied)."""

    def __init__(self, add: list[Callable[[grpc.Server], None]], service_names: list[str], host: str = "127.0.0.1",
                 workers: int = 4):
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        for fn in add:
            fn(self.server)
        self.port = self.server.add_insecure_port(f"{host}:0")
        self.endpoint = f"{host}:{self.port}"
        self.service_names = ["", *service_names]

    def start(self) -> "GrpcServer":
        self.server.start()
        for name in self.service_names:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self

    def stop(self, grace: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
