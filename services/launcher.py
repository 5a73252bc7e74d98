"""Local launcher: Redis, the services and the trainer ranks as child processes of one command.

Order of a run: Redis (the configured one, else an embedded one) -> the resolved config written to the run dir ->
services (dataloader, checkpointer; in an RL run rollout workers too, and the dataloader packs their stream) -> wait
until each has registered and its gRPC health says SERVING -> trainer ranks under torchrun, their output streamed to the
terminal. The run ends when the trainer exits; then the services are stopped and Redis last. Ctrl-C, SIGTERM, a
trainer failure or a service failing for good stops everything (process groups: SIGTERM, then SIGKILL after a grace
period) and the launcher says which child failed, with the tail of its log.

Restart policy: a service (a child that registers) that crashes while the trainer runs is restarted, at most
`run.max_restarts` times per service, each restart logged with the crash's log tail. Its dead registry record is
removed at once so that clients looking it up find only the replacement; the clients resume it (the dataloader from
the trainer's stream position, the checkpointer by re-sending an uncommitted save). The embedded Redis, too, is
restarted when it dies (at most `run.max_restarts` times), on its port and from its append-only file, so it comes back
with every key it had acknowledged; its clients retry meanwhile (services/common/registry.py). The trainer is never
restarted: a failed rank ends the run, and the next `foldmoe train` resumes from the newest valid checkpoint.

Every child is started in a session of its own so that a terminal Ctrl-C reaches the launcher alone and shutdown
happens in order; `procs` makes sure none of them, nor their children, outlives the launcher.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

# The launcher forks its children (fork, then `procs.die_with_parent`, then exec) after its health checks have started
# gRPC's threads. gRPC's fork handlers restart those threads in the child before its exec, where they can abort it
# ("Check failed: wakeup_fd_->ConsumeWakeup().ok()", a trainer lost so once in CI). No child uses gRPC before its exec,
# so the handlers are off here; gRPC reads the variable when it is first imported (below, through grpc_server).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import redis  # noqa: E402
import yaml  # noqa: E402

from services.common import procs  # noqa: E402
from services.common.config import Config  # noqa: E402
from services.common.embedded_redis import EmbeddedRedis, EmbeddedRedisError  # noqa: E402
from services.common.grpc_server import check as grpc_check  # noqa: E402
from services.common.registry import Registry, RegistryError, connect  # noqa: E402

# Registry record key under which a service publishes its gRPC address ("host:port"), so it can be health-checked.
GRPC_KEY = "grpc"
STATE_FILE = "launcher.json"  # in the run dir while a launcher runs; `foldmoe status` reads it
LOG_TAIL_LINES = 20
# torchrun appends its own traceback and failure summary after a worker dies; the worker's error is above this line.
_TORCHRUN_TRAILER = re.compile(r"torch/distributed/elastic/.*\] failed \(exitcode")


@dataclass(frozen=True)
class ChildSpec:
    name: str
    argv: list[str]
    registers_as: str = ""  # registry service name the launcher waits for before starting later children; "" = none
    stream: bool = False  # copy its output to the terminal (the trainer), besides its log file

    @property
    def restartable(self) -> bool:
        return bool(self.registers_as)  # services; the trainer's ranks share state that a restart cannot rebuild


def child_specs(config_file: Path, cfg: Config, python: str = sys.executable) -> list[ChildSpec]:
    """The processes of a local run, in start order. compose/docker-compose.yml runs the same commands."""
    conf = ["--config", str(config_file)]
    # RL (`rl.enabled`): rollout workers too, and the dataloader packs their stream instead of a corpus (see
    # services/dataloader/rollout_source.py). Workers register before they have weights, so they start with the
    # services and the RL trainer starts once they are up; a crashed worker is a crashed service.
    # `data.replicas` dataloaders run the same command: each claims a free replica index in the registry.
    replicas = cfg.data.replicas
    workers = [ChildSpec(f"rollout{i}", [python, "-m", "services.rl_rollout.worker", *conf], registers_as="rollout")
               for i in range(cfg.rl.workers)] if cfg.rl.enabled else []
    data = [ChildSpec(f"dataloader{i}" if replicas > 1 else "dataloader", [python, "-m", "services.dataloader.server",
                                                                           *conf], registers_as="dataloader")
            for i in range(replicas)]
    trainer = "services.trainer.rl.train_rl" if cfg.rl.enabled else "services.trainer.train"
    return [
        *workers,
        *data,
        ChildSpec("checkpointer", [python, "-m", "services.checkpointer.writer", *conf], registers_as="checkpointer"),
        # `python -m torch.distributed.run` is torchrun, without needing the venv's bin/ on PATH.
        ChildSpec("trainer", [python, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc_per_node={cfg.run.nproc}", "-m", trainer, *conf], stream=True),
    ]


class LaunchError(RuntimeError):
    """The run could not start or did not finish; the message says which process and why."""


class Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class Child:
    spec: ChildSpec
    proc: subprocess.Popen
    log_path: Path
    pump: threading.Thread | None = None
    restarts: int = 0  # times this child was restarted after a crash

    @property
    def name(self) -> str:
        return self.spec.name

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        if self.pump is not None:
            self.pump.join(timeout=2)  # the last bytes of a streamed child reach its log only when the pipe closes
        try:
            all_lines = self.log_path.read_text(errors="replace").rstrip("\n").splitlines()
        except OSError:
            return "  (no log)"
        cut = next((i for i, line in enumerate(all_lines) if _TORCHRUN_TRAILER.search(line)), len(all_lines))
        return "\n".join(f"  | {line}" for line in all_lines[:cut][-lines:]) or "  (log is empty)"


def exit_description(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class Launcher:
    cfg: Config
    run_dir: Path
    specs: Callable[[Path, Config], list[ChildSpec]] = child_specs
    start_timeout: float = 120.0  # seconds for the services to register and report healthy
    grace: float = 10.0  # seconds between SIGTERM and SIGKILL when stopping a child
    max_restarts: int | None = None  # per service; None: cfg.run.max_restarts
    out: IO[bytes] = field(default_factory=lambda: sys.stdout.buffer)
    err: IO[str] = field(default_factory=lambda: sys.stderr)
    children: list[Child] = field(default_factory=list, init=False)
    _signal: int = field(default=0, init=False)  # the first SIGINT/SIGTERM received
    _hurry: bool = field(default=False, init=False)  # a second signal: skip the grace periods
    _stopping: bool = field(default=False, init=False)
    _clean: bool = field(default=True, init=False)
    _keep: set[int] = field(default_factory=set, init=False)  # our own children that are not in `children`
    _url: str = field(default="", init=False)
    _redis_server: EmbeddedRedis | None = field(default=None, init=False)  # the embedded one, when started here
    _redis_restarts: int = field(default=0, init=False)
    _env: dict[str, str] = field(default_factory=dict, init=False)

    # ------------------------------------------------------------------ public

    def run(self) -> int:
        """Start everything, supervise, stop everything. Returns the process exit code for the CLI."""
        self.run_dir = Path(self.run_dir)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        # Orphans of a child that dies before its own children (torchrun's workers) are re-parented to us and swept.
        procs.become_subreaper()
        old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        code = 1
        try:
            with ExitStack() as stack:
                code = self._run(stack)
        except Interrupted as e:
            self.say(f"{e}: stopped every process of run {self.cfg.run.name!r}")
            code = 128 + e.signum
        except (LaunchError, RegistryError) as e:
            self.say(f"error: {e}")
            code = 1
        finally:
            (self.run_dir / STATE_FILE).unlink(missing_ok=True)
            for s, h in old_handlers.items():
                signal.signal(s, h)
        return code

    def say(self, msg: str) -> None:
        print(f"foldmoe: {msg}", file=self.err, flush=True)

    # ------------------------------------------------------------------ phases

    def _run(self, stack: ExitStack) -> int:
        url = self._url = self._redis(stack)
        if self.max_restarts is None:
            self.max_restarts = self.cfg.run.max_restarts
        stack.callback(self._stop_all)  # registered after Redis, so it runs before Redis stops
        cfg = replace(self.cfg, run=replace(self.cfg.run, redis_url=url))
        config_file = self.run_dir / "config.yaml"
        config_file.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        env = self._env = {**os.environ, "REDIS_URL": url, "PYTHONUNBUFFERED": "1",
                           "FOLDMOE_RUN_DIR": str(self.run_dir), procs.STOP_GRACE_ENV: str(self.grace)}
        specs = self.specs(config_file, cfg)
        services = [s for s in specs if s.registers_as]
        for spec in services:
            self._start(spec, env)
        self._write_state(url)
        self._wait_ready(url, services)
        for spec in specs:
            if not spec.registers_as:
                self._start(spec, env)
        self._write_state(url)
        return self._supervise()

    def _redis(self, stack: ExitStack) -> str:
        url = self.cfg.run.redis_url or os.environ.get("REDIS_URL", "")
        if url:
            connect(url).close()  # RegistryError names the URL and the fix
            self.say(f"using Redis at {url}")
            return url
        server = self._redis_server = stack.enter_context(EmbeddedRedis(self.run_dir / "redis"))
        self._keep.add(server.proc.pid)  # stopped after the children, not swept with their orphans
        self.say(f"started embedded Redis at {server.url}")
        return server.url

    def _start(self, spec: ChildSpec, env: dict[str, str], append: bool = False) -> Child:
        self._check_signal()
        log_path = self.run_dir / "logs" / f"{spec.name}.log"
        with open(log_path, "ab" if append else "wb") as log:
            proc = subprocess.Popen(spec.argv, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE if spec.stream else log, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=procs.die_with_parent)
        child = Child(spec, proc, log_path)
        self.children.append(child)
        if spec.stream:
            child.pump = threading.Thread(target=self._pump, args=(proc, log_path), name=f"pump:{spec.name}",
                                          daemon=True)
            child.pump.start()
        self.say(f"started {spec.name} (pid {proc.pid}, log {log_path})")
        return child

    def _pump(self, proc: subprocess.Popen, log_path: Path) -> None:
        # Raw chunks, not lines: progress bars redraw with '\r' and must reach the terminal as they are written.
        with open(log_path, "ab") as log:
            fd = proc.stdout.fileno()
            while chunk := os.read(fd, 65536):
                log.write(chunk)
                log.flush()
                try:
                    self.out.write(chunk)
                    self.out.flush()
                except (OSError, ValueError):
                    pass  # the terminal went away; keep the log complete

    def _wait_ready(self, url: str, services: list[ChildSpec]) -> None:
        registry = Registry(url, self.cfg.run.name)
        deadline = time.monotonic() + self.start_timeout
        for spec in services:
            count = sum(s.registers_as == spec.registers_as for s in services)  # replicas: all of them registered
            while len(records := registry.lookup(spec.registers_as)) < count:
                self._wait_step(spec, deadline, f"did not register as {spec.registers_as!r}")
            for address in [r[GRPC_KEY] for r in records if r.get(GRPC_KEY)]:
                while not grpc_check(address, timeout=1.0):
                    self._wait_step(spec, deadline, f"registered gRPC {address} but it did not report SERVING")
            self.say(f"{spec.name} is ready")

    def _wait_step(self, spec: ChildSpec, deadline: float, what: str) -> None:
        """One poll of a wait for `spec`: fail fast if any child died, or once the deadline has passed."""
        self._watch_redis()
        self._check_children()
        if time.monotonic() > deadline:
            raise LaunchError(f"{spec.name} {what} within {self.start_timeout:.0f}s (run {self.cfg.run.name!r}); "
                              f"its log: {self.run_dir / 'logs' / (spec.name + '.log')}")
        time.sleep(0.1)

    def _supervise(self) -> int:
        while True:
            self._check_signal()
            self._watch_redis()
            for child in self.children:
                code = child.proc.poll()
                if code is None:
                    continue
                if child.spec.restartable and child.restarts < self.max_restarts:
                    self._restart(child, code)
                    break  # `children` changed
                if child.spec.registers_as or code != 0:
                    self._fail(child, code)
                # The trainer finished: stop the services (they flush on SIGTERM) and report how they went.
                if child.pump is not None:
                    # Bounded: a leftover grandchild may hold the pipe open until the sweep in _stop_all ends it.
                    child.pump.join(timeout=2)
                if not self._stop_all():
                    return 1
                self.say(f"{child.name} finished; every service stopped cleanly")
                return 0
            time.sleep(0.2)

    def _restart(self, child: Child, code: int) -> None:
        """Replace a crashed service: its stale registration goes first, so no client picks the dead endpoints."""
        child.restarts += 1
        self.say(f"{child.name} {exit_description(code)}; restarting it ({child.restarts} of {self.max_restarts}, "
                 f"run.max_restarts); last lines of {child.log_path}:\n{child.log_tail()}")
        procs.stop_group(child.proc, 0.0)  # members of its group that outlived it (none expected) go with it
        self._forget_registration(child)
        with open(child.log_path, "ab") as log:
            marker = f"--- foldmoe: restart {child.restarts} after the process {exit_description(code)} ---"
            log.write(f"\n{marker}\n".encode())
        new = self._start(child.spec, self._env, append=True)
        new.restarts = child.restarts
        self.children.remove(new)
        self.children[self.children.index(child)] = new  # keep start order: it decides the stop order
        self._write_state(self._url)

    def _watch_redis(self) -> None:
        """Restart the embedded Redis if it died: on its port, from its append-only file (embedded_redis.py)."""
        server = self._redis_server
        if server is None or server.proc is None or (code := server.proc.poll()) is None:
            return
        log = f"last lines of {server.log_path}:\n{server.log_tail()}"
        if self._redis_restarts >= self.max_restarts:
            raise LaunchError(f"the embedded Redis {exit_description(code)} after {self._redis_restarts} restart(s) "
                              f"(run.max_restarts={self.max_restarts}); {log}")
        self._redis_restarts += 1
        self.say(f"the embedded Redis {exit_description(code)}; restarting it on {server.url} with its data "
                 f"({self._redis_restarts} of {self.max_restarts}, run.max_restarts); {log}")
        self._keep.discard(server.proc.pid)
        try:
            server.restart()
        except EmbeddedRedisError as e:
            raise LaunchError(str(e)) from None
        self._keep.add(server.proc.pid)
        self._write_state(self._url)

    def _forget_registration(self, child: Child) -> None:
        """Delete the registry records the dead process left (they would linger for the heartbeat TTL)."""
        try:
            registry = Registry(self._url, self.cfg.run.name)
            for record in registry.lookup(child.spec.registers_as):
                if record.get("pid") == child.proc.pid:
                    registry.client.delete(registry._key("svc", record["service"], record["instance"]))
        except (RegistryError, redis.RedisError) as e:
            self.say(f"could not remove the registration of the crashed {child.name} ({e}); clients skip it once its "
                     "heartbeat expires")

    # ------------------------------------------------------------------ failure and shutdown

    def _check_children(self) -> None:
        self._check_signal()
        for child in self.children:
            code = child.proc.poll()
            if code is not None:
                self._fail(child, code)

    def _fail(self, child: Child, code: int) -> None:
        what = exit_description(code) if code != 0 else "exited (code 0) while the run still needed it"
        if child.restarts:
            what += f" after {child.restarts} restart(s) (run.max_restarts={self.max_restarts})"
        raise LaunchError(f"{child.name} {what}; last lines of {child.log_path}:\n{child.log_tail()}")

    def _on_signal(self, signum: int, frame) -> None:
        # Only a flag: raising here could land between a fork and the bookkeeping of the new child.
        if self._signal:
            self._hurry = True  # a second Ctrl-C: no more grace periods
        self._signal = signum

    def _check_signal(self) -> None:
        if self._signal and not self._stopping:
            raise Interrupted(self._signal)

    def _stop_all(self) -> bool:
        """Stop children in reverse start order; True when every service stopped cleanly within its grace period."""
        if self._stopping:
            return self._clean
        self._stopping = True
        hurry = lambda: self._hurry  # noqa: E731
        # The trainer first (it feeds the others), then the services together: they are independent of each other.
        # Children that already exited go through the same stop: members of their process group may remain.
        for child in [c for c in reversed(self.children) if not c.spec.registers_as]:
            procs.stop_group(child.proc, self.grace, hurry)
        services = [c for c in reversed(self.children) if c.spec.registers_as]
        was_running = {c.name: c.proc.poll() is None for c in services}
        for child in services:
            procs.signal_group(child.proc, signal.SIGTERM)
        for child in services:
            graceful = procs.stop_group(child.proc, self.grace, hurry)
            code = child.proc.returncode
            if not graceful:
                self.say(f"{child.name} did not stop within {self.grace:.0f}s of SIGTERM and was killed; last lines "
                         f"of {child.log_path}:\n{child.log_tail()}")
                self._clean = False
            elif was_running[child.name] and code not in (0, -signal.SIGTERM):
                self.say(f"{child.name} {exit_description(code)} while stopping; last lines of {child.log_path}:\n"
                         f"{child.log_tail()}")
                self._clean = False
        for child in self.children:
            if child.pump is not None:
                child.pump.join(timeout=2)
        strays = procs.sweep_orphans(known={c.proc.pid for c in self.children} | self._keep)
        if strays:
            self.say(f"ended {len(strays)} leftover process(es) of this run: {strays}")
        return self._clean

    def _write_state(self, url: str) -> None:
        state = {"pid": os.getpid(), "run": self.cfg.run.name, "redis_url": url,
                 "children": {c.name: c.proc.pid for c in self.children}}
        if self._redis_server is not None and self._redis_server.proc is not None:
            state["redis_pid"] = self._redis_server.proc.pid
        tmp = self.run_dir / f"{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, self.run_dir / STATE_FILE)  # readers never see a half-written file
