"""`foldmoe` command line: train, preprocess, status, plot, save, generate, evaluate.

    foldmoe train      [--config FILE] [section.key=value ...]   start Redis, the services and the trainer ranks
                       (with rl.enabled: rollout workers and the RL trainer, e.g. --config configs/rl_tiny.yaml)
    foldmoe preprocess [--config FILE] [--force] [section.key=value ...]   tokenize the corpus into data.dataset_dir
    foldmoe status     [--config FILE] [section.key=value ...]   services (health, endpoints), step, checkpoint
    foldmoe plot       [--config FILE] [--metrics FILE] [--out DIR] [section.key=value ...]   PNG charts of a run
    foldmoe save       [--config FILE] [--wait] [section.key=value ...]   a checkpoint of the running trainer, now
    foldmoe generate   [--checkpoint SPEC] [--prompt TEXT ...] ...   complete prompts (services/rl_rollout/generate.py)
    foldmoe evaluate   [--checkpoint SPEC] [--corpus PATH]... ...   loss and perplexity (services/trainer/
                       evaluate_checkpoint.py)

A mistake in the config, a missing corpus or an unreachable Redis is reported as one line naming the cause and the fix,
with a non-zero exit code, before any process is started.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from services.common.command import EXIT_USAGE  # a config or data problem the user must fix
from services.common.config import Config, ConfigError, load_config, validate

EXIT_FAILED = 1  # the run started and something failed


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="foldmoe",
                                     description="Mixture-of-Experts training as a pipeline of services")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in (("train", "run a training job: Redis, dataloader, checkpointer, trainer ranks"),
                            ("preprocess", "tokenize the corpus into data.dataset_dir (train does this when needed)"),
                            ("status", "show the registered services (health, endpoints), step and latest checkpoint"),
                            ("plot", "draw loss, throughput and expert-load charts of a run as PNG files"),
                            ("save", "ask the running trainer for a checkpoint now, through the checkpointer"),
                            ("generate", "complete prompts with a trained checkpoint (see `foldmoe generate -h`)"),
                            ("evaluate", "a checkpoint's loss and perplexity on a corpus or the held-out set (see "
                             "`foldmoe evaluate -h`)")):
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--config", type=Path, default=None, help="YAML config (default: built-in tiny CPU run)")
        sub.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, later wins")
        if name == "plot":
            sub.add_argument("--metrics", type=Path, default=None,
                             help="JSONL step records (default: run.metrics_file)")
            sub.add_argument("--out", type=Path, default=None, help="directory for the PNGs (default: run.dir/plots)")
        if name == "save":
            sub.add_argument("--wait", action="store_true", help="return once the save is committed")
            sub.add_argument("--timeout", type=float, default=600.0, help="seconds --wait waits (default 600)")
    return parser


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    # One line: the messages already name the cause and the fix; a traceback would bury them.
    print(f"foldmoe: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return code


def _ensure_dataset(cfg: Config) -> None:
    from services.dataloader.errors import DataError
    from services.dataloader.preprocess import ensure_dataset

    try:
        ensure_dataset(cfg)
    except DataError as e:
        raise _UserError(str(e)) from None


class _UserError(Exception):
    pass


def _check_redis(cfg: Config) -> None:
    """A configured Redis must answer now; with none configured the launcher starts an embedded one."""
    import redis

    if cfg.run.redis_url:
        url, source, fix = cfg.run.redis_url, "run.redis_url", "leave run.redis_url empty"
    elif os.environ.get("REDIS_URL"):
        url, source, fix = os.environ["REDIS_URL"], "the REDIS_URL environment variable", "unset REDIS_URL"
    else:
        return
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
        client.ping()
        client.close()
    except (redis.RedisError, ValueError) as e:
        reason = str(e).rstrip(".")
        raise _UserError(f"cannot reach Redis at {url!r} (from {source}): {reason}; start it, fix the URL, or {fix} "
                         "so foldmoe starts an embedded Redis") from None


def train(cfg: Config) -> int:
    from services.launcher import Launcher

    validate(cfg, world_size=cfg.run.nproc)
    if cfg.rl.enabled:
        from services.trainer.rl.train_rl import validate_rl

        validate_rl(cfg, world_size=cfg.run.nproc)  # the ranks the launcher is about to start
        from services.rl_rollout.prompts import rl_prompts

        prompts = rl_prompts(cfg.rl, cfg.run.seed)  # the workers' task, reward, prompts: refused before any process
        if prompts.records is not None:
            records, per_step = len(prompts.records), cfg.rl.groups_per_step
            print(f"foldmoe: rl.prompts: {records} records to train on, {len(prompts.eval)} held for evaluation; "
                  f"an epoch is {records / per_step:g} steps of {per_step} groups, {cfg.run.steps} steps "
                  f"{cfg.run.steps * per_step / records:.2f} epochs", file=sys.stderr, flush=True)
    _check_redis(cfg)  # cheap checks first: an unreachable Redis should not wait for a corpus to be tokenized
    if not cfg.rl.enabled:  # an RL run's data is the rollout workers' trajectories, not a corpus
        _ensure_dataset(cfg)
    return Launcher(cfg, Path(cfg.run.dir)).run()


# Run-state key naming the newest committed checkpoint, {"step", "path"}: the checkpoint writer sets it at each commit.
LATEST_CHECKPOINT_KEY = "checkpoint/latest"


def _show(value) -> str:
    return "-" if value is None else value if isinstance(value, str) else json.dumps(value)


def _health(record: dict) -> str:
    """SERVING / NOT-SERVING from the service's gRPC health endpoint; "-" for one without gRPC."""
    from services.common.grpc_server import check

    address = record.get("grpc")
    if not address:
        return "-"
    return "SERVING" if check(address, timeout=1.0) else "NOT-SERVING"


def _rollout_status(record: dict) -> str:
    """A rollout worker's RolloutControl.Status in a few words; "" when it does not answer."""
    import grpc

    from proto import rollout_pb2, rollout_pb2_grpc
    from services.common import net

    address = record.get("grpc")
    if not address:
        return ""
    try:
        with grpc.insecure_channel(address) as channel:
            s = rollout_pb2_grpc.RolloutControlStub(channel).Status(
                rollout_pb2.RolloutStatusRequest(), timeout=1.0, metadata=net.call_metadata(net.auth_token()))
    except grpc.RpcError:
        return ""
    return (f"weights v{s.weights_version} (newest seen v{s.newest_version_seen}), {s.groups_published} groups, "
            f"{s.tokens_generated} tokens")


def _last_record(path: Path) -> str:
    """The trainer's newest step record, in a few numbers; "" when there is none yet."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        record = json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return ""
    if not isinstance(record, dict):
        return ""
    shown = [f"{key} {record[key]:.4g}" for key in ("loss", "grad_norm", "tokens_per_s", "mfu", "data_wait_s",
                                                    "ckpt_stall_s", "eval_loss")
             if isinstance(record.get(key), (int, float))]
    return f"step {record.get('step', '?')}: " + ", ".join(shown)


def _running(cfg: Config):
    """The Redis URL and Registry of the run `cfg` names: run.redis_url, REDIS_URL, or the embedded Redis of a launcher
    running in run.dir."""
    from services.common.registry import Registry
    from services.launcher import STATE_FILE

    url = cfg.run.redis_url or os.environ.get("REDIS_URL", "")
    state_file = Path(cfg.run.dir) / STATE_FILE
    if not url and state_file.is_file():
        url = json.loads(state_file.read_text())["redis_url"]  # the embedded Redis of a running launcher
    if not url:
        raise _UserError(f"no running launcher in {cfg.run.dir} (no {STATE_FILE}) and no run.redis_url or REDIS_URL "
                         "set; start a run with `foldmoe train` or point at its Redis")
    return url, Registry(url, cfg.run.name)


def status(cfg: Config, args=None) -> int:
    url, registry = _running(cfg)
    print(f"run {cfg.run.name!r} on {url}")
    services = registry.services()
    for rec in services:
        endpoints = {k: v for k, v in rec.items() if k not in ("service", "instance", "host", "pid", "started")}
        print(f"  {rec['service']:<14} {rec['instance']:<28} pid {rec['pid']:<8} {_health(rec):<11} "
              f"{json.dumps(endpoints)}")
        if rec["service"] == "rollout" and (detail := _rollout_status(rec)):
            print(f"  {'':<14} {detail}")
    if not services:
        print("  (no services registered)")
    print(f"step: {_show(registry.get_state('step'))}")
    print(f"latest checkpoint: {_show(registry.get_state(LATEST_CHECKPOINT_KEY))}")
    last = _last_record(Path(cfg.run.metrics_file))
    if last:
        print(f"last record ({cfg.run.metrics_file}) {last}")
    return 0


def plot(cfg: Config, args) -> int:
    from services.common.plot import PlotError, plot_run

    metrics = args.metrics or Path(cfg.run.metrics_file)
    out = args.out or Path(cfg.run.dir) / "plots"
    try:
        paths = plot_run(metrics, out)
    except PlotError as e:
        raise _UserError(str(e)) from None
    for path in paths:
        print(path)
    return 0


def save(cfg: Config, args) -> int:
    """Asks the run's checkpointer for a save now (its gRPC `Save`); with --wait, until it is committed."""
    import grpc

    from proto import checkpointer_pb2 as pb
    from proto import checkpointer_pb2_grpc as pb_grpc
    from services.common import net

    url, registry = _running(cfg)
    writers = registry.lookup("checkpointer")
    if not writers:
        raise _UserError(f"no checkpointer of run {cfg.run.name!r} is registered on {url}")
    address = writers[0]["grpc"]
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.CheckpointerStub(channel)
        try:
            reply = stub.Save(pb.SaveRequest(wait=args.wait), metadata=net.call_metadata(net.auth_token()),
                              timeout=args.timeout if args.wait else 30)
        except grpc.RpcError as e:
            raise _UserError(f"checkpointer at {address}: {e.details() or e.code().name}") from None
    what = "the run's last step, which saves anyway" if reply.last else "the next step no rank has reached"
    print(f"save of step {reply.step} asked ({what})")
    if reply.path:
        print(f"committed: {reply.path}")
    return 0


COMMANDS = {"train": lambda cfg, args: train(cfg), "status": status, "plot": plot, "save": save}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["preprocess"]:
        # The dataloader owns preprocessing and its options (--force, --workers); this is only its front door.
        from services.dataloader.preprocess import main as preprocess_main

        return preprocess_main(argv[1:])
    if argv[:1] == ["generate"]:  # its own options (sampling, prompts): services/rl_rollout/generate.py
        from services.rl_rollout.generate import main as generate_main

        return generate_main(argv[1:])
    if argv[:1] == ["evaluate"]:  # its own options (corpus, token cap): services/trainer/evaluate_checkpoint.py
        from services.trainer.evaluate_checkpoint import main as evaluate_main

        return evaluate_main(argv[1:])
    args = _parser().parse_args(argv)
    from services.common.embedded_redis import EmbeddedRedisError
    from services.common.registry import RegistryError

    try:
        cfg = load_config(args.config, args.overrides)
        return COMMANDS[args.command](cfg, args)
    except ConfigError as e:
        return _fail(f"config: {e}")
    except _UserError as e:
        return _fail(str(e))
    except (RegistryError, EmbeddedRedisError) as e:
        return _fail(str(e), EXIT_FAILED)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
