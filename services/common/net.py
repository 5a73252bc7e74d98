"""Where services listen, what they advertise, and the shared token that authenticates their clients.

Binding: every gRPC, ZMQ and metrics endpoint listens on `run.bind_host` (127.0.0.1 unless configured) and registers
in Redis the address clients must dial: `run.advertise_host`, else the bind host, else (a wildcard bind such as
0.0.0.0, which no client can dial) this host's name.

Authentication: when the environment variable FOLDMOE_AUTH_TOKEN is set (in every process of the run: the launcher
passes its environment to its children), servers refuse requests that do not carry it, and clients send it. It is
never read from a config file, so the resolved config the launcher writes to the run dir does not hold a secret.
- gRPC: metadata `authorization: Bearer <token>`; a call without it fails with UNAUTHENTICATED and the server keeps
  serving. The standard health service stays open: health checks (the launcher, compose, grpc_health_probe) learn
  only whether the service is up, and they need no secret to do so.
- ZMQ: the `token` field of each request's `Envelope` header (services/common/wire.py); a request without it is
  answered with the protocol's error message.
- Prometheus metrics (HTTP) are not authenticated: they are read-only counters; keep them on a trusted network.
Tokens are compared in constant time (`hmac.compare_digest`).
"""

from __future__ import annotations

import hmac
import os
import socket

import grpc

TOKEN_ENV = "FOLDMOE_AUTH_TOKEN"
OPEN_SERVICES = ("/grpc.health.v1.Health/",)  # gRPC methods (by prefix) that need no token
_WILDCARDS = ("", "0.0.0.0", "::", "*")


def auth_token() -> str:
    """The run's shared token ("" = authentication off)."""
    return os.environ.get(TOKEN_ENV, "")


def token_ok(given: str | bytes, expected: str) -> bool:
    """True when no token is required or `given` is it (constant time)."""
    if not expected:
        return True
    given = given.encode() if isinstance(given, str) else bytes(given)
    return hmac.compare_digest(given, expected.encode())


def refusal(given: str | bytes) -> str:
    """Why a request was refused, and the fix."""
    what = "carries the wrong auth token" if given else "carries no auth token"
    return f"request {what}; give every process of the run the same {TOKEN_ENV}"


def advertised(bind_host: str, advertise_host: str = "") -> str:
    """The host clients dial for an endpoint bound to `bind_host` (see the module docstring)."""
    if advertise_host:
        return advertise_host
    return socket.gethostname() if bind_host in _WILDCARDS else bind_host


# ---------------------------------------------------------------- gRPC


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call but the open services' unless its `authorization` metadata is `Bearer <token>`."""

    def __init__(self, token: str):
        self.token = token

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if token_ok(given.removeprefix("Bearer ") if given.startswith("Bearer ") else "", self.token):
            return handler
        return _refuse(handler, refusal(given))


def _refuse(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    def abort(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[handler.request_streaming, handler.response_streaming](
        abort, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


def server_interceptors(token: str) -> list[grpc.ServerInterceptor]:
    return [TokenInterceptor(token)] if token else []


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Metadata a client passes with each gRPC call."""
    return (("authorization", f"Bearer {token}"),) if token else ()
