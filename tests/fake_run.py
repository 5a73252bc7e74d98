"""Stand-in children for supervising tests of the launcher: services that register (and serve gRPC health) and a
trainer that prints steps, each able to misbehave on request.

    python tests/fake_run.py launch RUN_DIR [--grace S] [--start-timeout S] [--max-restarts N] [--child NAME:FLAG ...]
    python tests/fake_run.py service NAME --config FILE [--crash-after S] [--crash-once FILE] [--ignore-term]
                                                        [--slow-stop] [--no-register] [--grpc]
    python tests/fake_run.py trainer --config FILE [--steps N] [--fail-at K] [--orphan]

`launch` runs the real `Launcher` with the fake children; each --child adds flags to one of them, e.g.
`checkpointer:--crash-after=1` or `trainer:--fail-at=2`.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.common.config import Config, load_config  # noqa: E402

ME = str(Path(__file__).resolve())


def launch(args: argparse.Namespace) -> int:
    from services.launcher import ChildSpec, Launcher

    extra: dict[str, list[str]] = {}
    for item in args.child_args:
        name, _, flags = item.partition(":")
        extra.setdefault(name, []).extend(f for f in flags.split(",") if f)

    def specs(config_file: Path, cfg: Config) -> list[ChildSpec]:
        conf = ["--config", str(config_file)]
        py = sys.executable
        return [
            ChildSpec("dataloader", [py, ME, "service", "dataloader", "--grpc", *conf, *extra.get("dataloader", [])],
                      registers_as="dataloader"),
            ChildSpec("checkpointer", [py, ME, "service", "checkpointer", *conf, *extra.get("checkpointer", [])],
                      registers_as="checkpointer"),
            ChildSpec("trainer", [py, ME, "trainer", *conf, *extra.get("trainer", [])], stream=True),
        ]

    cfg = load_config(None, [f"run.name={args.name or f'fake-{os.getpid()}'}", f"run.dir={args.run_dir}"])
    return Launcher(cfg, Path(args.run_dir), specs=specs, grace=args.grace, start_timeout=args.start_timeout,
                    max_restarts=args.max_restarts).run()


def service(args: argparse.Namespace) -> int:
    from services.common.grpc_server import serve
    from services.common.registry import Registry, redis_url

    cfg = load_config(args.config)
    stop = threading.Event()
    if args.ignore_term:
        signal.signal(signal.SIGTERM, lambda *_: print(f"fake {args.name}: ignoring SIGTERM", flush=True))
    elif args.slow_stop:  # as the real services: the stop event, and the stack dump when the stop is slow
        from services.common import procs

        procs.stop_on_signals(stop)
    else:
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    info = {}
    if args.grpc:
        server, port = serve(service_names=[f"fake.{args.name}"])
        info["grpc"] = f"127.0.0.1:{port}"
    heartbeat = None if args.no_register else Registry(redis_url(), cfg.run.name).register(args.name, info)
    print(f"fake {args.name}: up", flush=True)
    crash = args.crash_after > 0
    if crash and args.crash_once:  # only the first incarnation crashes: the file remembers it did
        crash = not Path(args.crash_once).exists()
        Path(args.crash_once).touch()
    deadline = time.monotonic() + args.crash_after if crash else None
    while not stop.wait(0.05):
        if deadline and time.monotonic() > deadline:
            print(f"fake {args.name}: disk full, giving up", file=sys.stderr, flush=True)
            os._exit(3)  # a crash: no clean deregistration
    if heartbeat:
        heartbeat.stop()
    if args.slow_stop:
        finishing_a_write_that_never_ends()
    print(f"fake {args.name}: stopped on SIGTERM", flush=True)
    return 0


def finishing_a_write_that_never_ends() -> None:
    time.sleep(3600)


def trainer(args: argparse.Namespace) -> int:
    from services.common.registry import Registry, redis_url

    registry = Registry(redis_url(), load_config(args.config).run.name)
    if args.orphan:
        # Like torchrun's workers: a grandchild in a session of its own, which a process-group stop cannot reach.
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    for step in range(1, args.steps + 1):
        if step == args.fail_at:
            print(f"fake trainer: NaN loss at step {step}", flush=True)
            return 5
        print(f"step {step}/{args.steps} loss 1.0", flush=True)
        registry.set_state("step", step)
        time.sleep(args.step_time)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("launch")
    p.add_argument("run_dir")
    p.add_argument("--grace", type=float, default=5.0)
    p.add_argument("--start-timeout", type=float, default=30.0)
    p.add_argument("--name", default="", help="run name (default: fake-PID)")
    p.add_argument("--max-restarts", type=int, default=None, help="default: the config's run.max_restarts")
    p.add_argument("--child", dest="child_args", action="append", default=[], metavar="NAME:FLAGS")
    p = sub.add_parser("service")
    p.add_argument("name")
    p.add_argument("--config", required=True)
    p.add_argument("--crash-after", type=float, default=0.0)
    p.add_argument("--crash-once", default="", help="crash only when this file does not exist yet (then create it)")
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--slow-stop", action="store_true", help="on SIGTERM, hang in a function named for it")
    p.add_argument("--no-register", action="store_true")
    p.add_argument("--grpc", action="store_true")
    p = sub.add_parser("trainer")
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--fail-at", type=int, default=0)
    p.add_argument("--orphan", action="store_true")
    args = parser.parse_args()
    return {"launch": launch, "service": service, "trainer": trainer}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
