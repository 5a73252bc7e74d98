"""The shared gRPC helpers: a server on a free loopback port with the standard health service, and a client wait."""

from __future__ import annotations

import time

import pytest

from services.common.embedded_redis import free_port
from services.common.grpc_server import GrpcUnavailable, check, serve, wait_healthy


def test_server_reports_serving_for_itself_and_its_named_services():
    server, port = serve(service_names=["foldmoe.v1.Dataloader"])
    try:
        assert port > 0
        address = f"127.0.0.1:{port}"
        wait_healthy(address, timeout=5)
        wait_healthy(address, timeout=5, service="foldmoe.v1.Dataloader")
        assert not check(address, service="foldmoe.v1.SomethingElse")
    finally:
        server.stop(0).wait()


def test_servicers_passed_in_are_registered_on_the_server():
    added = []
    server, _ = serve(add_servicers=[added.append])
    try:
        assert added == [server]
    finally:
        server.stop(0).wait()


def test_wait_healthy_names_the_address_when_nothing_answers():
    address = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(GrpcUnavailable, match=address):
        wait_healthy(address, timeout=1)
    assert time.monotonic() - t0 < 5


def test_a_stopped_server_is_no_longer_healthy():
    server, port = serve()
    server.stop(0).wait()
    assert not check(f"127.0.0.1:{port}")
