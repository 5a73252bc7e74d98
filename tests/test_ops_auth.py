"""Binding and the shared auth token (services/common/net.py).

Specification: with a token, every gRPC call (but health) and every ZMQ request without it, or with a wrong one, is
refused with an error that names the cause, and the service keeps serving; the right token works; endpoints bind
`run.bind_host` and register an address a client can dial (never 0.0.0.0).
"""

from __future__ import annotations

import socket
import threading

import grpc
import pytest
import torch
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import checkpointer_pb2, checkpointer_pb2_grpc
from proto import dataloader_pb2 as pb
from proto import dataloader_pb2_grpc as pb_grpc
from services.checkpointer.control import serve_grpc
from services.checkpointer.snapshot import SaveError, Snapshotter
from services.checkpointer.store import CheckpointStore
from services.checkpointer.writer import Writer
from services.common import net, wire
from services.dataloader.client import DataClient
from services.dataloader.errors import DataError
from services.dataloader.server import DataLoaderServer
from services.rl_rollout.weights import WeightReceiver, WeightSyncError
from services.trainer.rl.weight_publisher import WeightPublisher
from tests.test_dataloader_service import make_cfg

TOKEN = "s3cret-token"


def test_wire_checks_the_token_before_the_payload():
    frames = wire.encode("k", pb.DataCredit(credits=1), {"x": torch.arange(3)}, token=TOKEN)
    assert wire.decode(frames, pb.DataCredit, token=TOKEN)[1].credits == 1
    assert wire.decode(frames)[0] == "k"  # a receiver without a token ignores it
    for sent in ("", "s3cret-tokeN"):
        with pytest.raises(wire.Unauthenticated, match="auth token.*FOLDMOE_AUTH_TOKEN") as e:
            wire.decode(wire.encode("k", pb.DataCredit(credits=1), token=sent), pb.DataCredit, token=TOKEN)
        assert e.value.kind == "k" and pb.DataCredit.FromString(e.value.body).credits == 1


def test_the_token_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(net.TOKEN_ENV, "from-env")
    assert net.auth_token() == "from-env"
    assert WeightReceiver("tcp://127.0.0.1:9", timeout_s=0.1).token == "from-env"
    monkeypatch.delenv(net.TOKEN_ENV)
    assert net.auth_token() == ""


def data_client(server, token):
    return DataClient(server.zmq_endpoint, server.grpc_endpoint, dp_rank=0, dp_size=1, grad_accum=2, timeout=5,
                      token=token)


def test_dataloader_refuses_clients_without_the_token_and_keeps_serving(tmp_path):
    server = DataLoaderServer(make_cfg(tmp_path), token=TOKEN).start()
    try:
        with grpc.insecure_channel(server.grpc_endpoint) as ch:  # gRPC control, no metadata: UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.DataLoaderStub(ch).Status(pb.DataStatusRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "no auth token" in e.value.details()
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # health stays open
        for token in ("", "wrong"):
            c = data_client(server, token)
            with pytest.raises(DataError, match="dataloader refused ResumeFromState: request carries"):
                c.next_step()
            c.close()
        c = data_client(server, TOKEN)
        c.resume(None)
        c.token = "wrong"  # gRPC passed; now the ZMQ hello goes out without the right token
        c._join()
        with pytest.raises(DataError, match="refused: request carries the wrong auth token"):
            c.next_step()
        c.close()
        c = data_client(server, TOKEN)
        assert len(c.next_step()) == 2 and c.status()["micro_batches_sent"] >= 2
        c.close()
    finally:
        server.stop()


@pytest.fixture
def writer(tmp_path):
    writer = Writer(CheckpointStore(tmp_path / "ckpt", keep_last=2), None, token=TOKEN)
    stop = threading.Event()
    thread = threading.Thread(target=writer.serve, args=(stop,), daemon=True)
    thread.start()
    yield writer
    stop.set()
    thread.join(10)


def save_one(endpoint, token, step):
    saver = Snapshotter(endpoint, token=token, timeout_s=20, share_memory=False)
    try:
        saver.save(step, {"w": torch.arange(6.0)})
        return saver.wait(20)
    finally:
        saver.close()


def test_checkpointer_refuses_a_save_without_the_token_and_commits_one_with_it(writer, tmp_path):
    for token in ("", "wrong"):
        with pytest.raises(SaveError, match="checkpointer refused the save: request carries"):
            save_one(writer.endpoint, token, step=1)
    assert save_one(writer.endpoint, TOKEN, step=2)
    assert CheckpointStore(tmp_path / "ckpt", keep_last=2).latest_step() == 2
    server, address = serve_grpc(writer.store, writer, token=TOKEN)
    try:
        with grpc.insecure_channel(address) as ch:
            stub = checkpointer_pb2_grpc.CheckpointerStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                stub.List(checkpointer_pb2.ListRequest(), timeout=5, metadata=net.call_metadata("wrong"))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            reply = stub.List(checkpointer_pb2.ListRequest(), timeout=5, metadata=net.call_metadata(TOKEN))
            assert [c.step for c in reply.checkpoints] == [2]
    finally:
        server.stop(0)


def test_weight_publisher_answers_a_wrong_token_with_an_error_and_keeps_serving():
    publisher = WeightPublisher(chunk_bytes=4096, token=TOKEN).start()
    try:
        publisher.publish(3, {"w": torch.ones(4)})
        for token in ("", "wrong"):
            receiver = WeightReceiver(publisher.endpoint, timeout_s=5, token=token)
            with pytest.raises(WeightSyncError, match="refused: request carries"):
                receiver.latest()
            receiver.close()
        receiver = WeightReceiver(publisher.endpoint, timeout_s=5, token=TOKEN)
        assert receiver.latest().version == 3
        receiver.close()
    finally:
        publisher.stop()


def test_advertised_host_is_dialable():
    assert net.advertised("127.0.0.1") == "127.0.0.1"
    assert net.advertised("0.0.0.0") == socket.gethostname()
    assert net.advertised("0.0.0.0", "node7.cluster") == "node7.cluster"


def host_ip() -> str:
    """A non-loopback address of this host where there is one (a UDP connect sends nothing), else 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def test_services_bind_the_configured_host_and_register_a_dialable_address(tmp_path):
    cfg = make_cfg(tmp_path, "run.bind_host=0.0.0.0", "run.advertise_host=localhost")
    server = DataLoaderServer(cfg).start()
    try:
        for endpoint in (server.zmq_endpoint, server.grpc_endpoint, server.metrics_endpoint):
            assert "0.0.0.0" not in endpoint and "localhost:" in endpoint
        port = server.zmq_endpoint.rsplit(":", 1)[1]
        assert server._router.getsockopt(zmq.LAST_ENDPOINT).decode() == f"tcp://0.0.0.0:{port}"
        # Bound to every interface: reachable through this host's network address too, not only the advertised one.
        ip = host_ip()
        grpc_port = server.grpc_endpoint.rsplit(":", 1)[1]
        c = DataClient(f"tcp://{ip}:{port}", f"{ip}:{grpc_port}", dp_rank=0, dp_size=1, grad_accum=2, timeout=10)
        assert len(c.next_step()) == 2
        c.close()
    finally:
        server.stop()
    loopback = DataLoaderServer(make_cfg(tmp_path)).start()  # the default: loopback only
    try:
        assert loopback.zmq_endpoint.startswith("tcp://127.0.0.1:")
        assert loopback._router.getsockopt(zmq.LAST_ENDPOINT).decode() == loopback.zmq_endpoint
        assert loopback.grpc_endpoint.startswith("127.0.0.1:")
    finally:
        loopback.stop()
