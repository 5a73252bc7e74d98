"""compose/docker-compose.yml runs the launcher's topology: each service's command is exactly the launcher's, the
trainer reserves GPUs and runs under torchrun, the services have gRPC health checks (rollout workers a registry one),
crashed services are restarted as often as the launcher restarts them and the trainers never, Redis too, from an
append-only file that its flags really keep (a redis-server run with them here), every container shares the `pod`'s
namespaces, rollout workers sit behind the `rl` profile, and `docker-compose config` accepts the file."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
import yaml

from services.common import grpc_server
from services.common.embedded_redis import find_redis_server, free_port
from services.common.config import load_config
from services.common.registry import Registry
from services.launcher import child_specs

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose" / "docker-compose.yml"
DEFAULT_CONFIG = "configs/tiny.yaml"


def interpolate(value, env: dict[str, str]):
    """Compose's `${VAR:-default}` substitution, enough for this file."""
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1), m.group(2)), value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def services(env: dict[str, str] | None = None) -> dict:
    return interpolate(yaml.safe_load(COMPOSE.read_text())["services"], env or {})


@pytest.mark.parametrize("env", [{}, {"FOLDMOE_CONFIG": "configs/qwen3_30b_a3b.yaml", "FOLDMOE_NPROC": "8"}],
                         ids=["defaults", "overridden"])
def test_service_commands_are_the_launchers(env):
    config = env.get("FOLDMOE_CONFIG", DEFAULT_CONFIG)
    cfg = load_config(ROOT / config, [f"run.nproc={env.get('FOLDMOE_NPROC', '1')}"])
    compose = services(env)
    for spec in child_specs(Path(config), cfg, python="python"):
        assert compose[spec.name]["command"] == spec.argv, spec.name


def test_dataloader_replicas_are_the_scaled_compose_dataloader():
    cfg = load_config(ROOT / DEFAULT_CONFIG, ["data.replicas=3"])
    specs = {spec.name: spec.argv for spec in child_specs(Path(DEFAULT_CONFIG), cfg, python="python")}
    dataloaders = [name for name in specs if name.startswith("dataloader")]
    assert dataloaders == ["dataloader0", "dataloader1", "dataloader2"]  # one compose service, `--scale dataloader=3`
    assert all(specs[name] == services()["dataloader"]["command"] for name in dataloaders)


@pytest.mark.parametrize("env", [{}, {"FOLDMOE_CONFIG": "configs/rl_tiny.yaml", "FOLDMOE_NPROC": "2"}],
                         ids=["defaults", "overridden"])
def test_rl_profile_runs_the_launchers_rl_commands(env):
    config = env.get("FOLDMOE_CONFIG", "configs/rl_tiny.yaml")
    cfg = load_config(ROOT / config, [f"run.nproc={env.get('FOLDMOE_NPROC', '1')}"])
    compose = services(env)
    specs = {spec.name: spec.argv for spec in child_specs(Path(config), cfg, python="python")}
    assert cfg.rl.enabled and "rollout0" in specs  # one compose service, scaled, for the launcher's rollout<i>
    assert compose["rollout"]["command"] == specs["rollout0"]
    assert compose["rl_trainer"]["command"] == specs["trainer"]


def test_trainer_reserves_gpus_and_runs_under_torchrun():
    trainer = services()["trainer"]
    assert trainer["command"][:3] == ["python", "-m", "torch.distributed.run"]
    devices = trainer["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert set(trainer["depends_on"]) == {"dataloader", "checkpointer"}
    assert all(dep["condition"] == "service_healthy" for dep in trainer["depends_on"].values())


def test_services_have_grpc_health_checks_and_redis_a_ping():
    compose = services()
    for name in ("dataloader", "checkpointer"):
        test = compose[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "services.common.grpc_server"], name
        assert test[-1] == name
    assert compose["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


@pytest.mark.parametrize("config", [DEFAULT_CONFIG, "configs/rl_tiny.yaml"])
def test_restart_policies_are_the_launchers(config):
    # The launcher restarts each crashed service (a child that registers) up to run.max_restarts times and never the
    # trainer. Docker's only bounded policy is on-failure:N; the trainers must not restart at all.
    cfg = load_config(ROOT / config)
    compose = services()
    specs = child_specs(Path(config), cfg, python="python")
    restartable = {re.sub(r"\d+$", "", s.name) for s in specs if s.restartable}  # dataloader<i>, rollout<i>: scaled
    assert restartable == {"dataloader", "checkpointer"} | ({"rollout"} if cfg.rl.enabled else set())
    assert not any(s.restartable for s in specs if s.name == "trainer")
    # Redis, as the launcher's embedded one (launcher.py `_watch_redis`), comes back from its append-only file
    for name in ("dataloader", "checkpointer", "rollout", "redis"):
        assert compose[name]["restart"] == f"on-failure:{cfg.run.max_restarts}", name
    for name in ("trainer", "rl_trainer", "preprocess"):
        assert compose[name]["restart"] == "no", name  # the string: a bare `no` in YAML is False
    assert "restart" not in compose["pod"]  # the namespaces' holder only sleeps; restarted, it would strand the others


def test_every_container_joins_the_pods_namespaces_and_redis_keeps_its_file_in_the_pods_shared_memory():
    compose = services()
    pod = compose.pop("pod")
    assert pod["ipc"] == "shareable" and pod["command"] == ["sleep", "infinity"] and pod["init"] is True
    for name, service in compose.items():
        assert {k: service.get(k) for k in ("network_mode", "ipc", "pid")} == dict.fromkeys(
            ("network_mode", "ipc", "pid"), "service:pod"), name
        assert "shm_size" not in service, name  # one /dev/shm, the pod's
    flags = redis_flags(compose["redis"]["command"])
    # Every write on file before the reply, the file in the pod's /dev/shm: it outlives a Redis container, not the pod
    assert flags["appendonly"] == "yes" and flags["appendfsync"] == "always" and flags["dir"] == "/dev/shm"
    assert flags["save"] == "" and flags["bind"] == "127.0.0.1"


def redis_flags(command: list[str]) -> dict[str, str]:
    assert command[0] == "redis-server" and len(command) % 2 == 1, command
    return {k.removeprefix("--"): v for k, v in zip(command[1::2], command[2::2], strict=True)}


def test_the_compose_redis_flags_bring_back_every_acknowledged_key_after_a_kill(tmp_path):
    # The compose file's own redis-server command, run here with a port and directory of the test's, killed with
    # SIGKILL (no shutdown save) and started again with the same command.
    flags = {**redis_flags(services()["redis"]["command"]), "dir": str(tmp_path), "port": str(free_port()),
             "logfile": str(tmp_path / "redis.log")}
    command = [find_redis_server(), *(x for k, v in flags.items() for x in (f"--{k}", v))]

    def start() -> tuple[subprocess.Popen, redis.Redis]:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=int(flags["port"]), decode_responses=True)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return proc, client
            except redis.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "redis.log").read_text()
                time.sleep(0.05)

    proc, client = start()
    try:
        client.set("run:state", "step 7")
        client.set("run:record", "alive", ex=600)
        entry = client.xadd("run:trajectories", {"group": "0"})
        proc.kill()
        proc.wait()
        proc, client = start()
        assert client.get("run:state") == "step 7"
        assert 0 < client.ttl("run:record") <= 600
        assert [e[0] for e in client.xrange("run:trajectories")] == [entry]
    finally:
        proc.kill()
        proc.wait()


def test_rl_trainer_waits_for_healthy_services_and_rollout_workers():
    compose = services()
    depends = compose["rl_trainer"]["depends_on"]
    assert set(depends) == {"dataloader", "checkpointer", "rollout"}
    assert all(dep["condition"] == "service_healthy" for dep in depends.values())
    check = compose["rollout"]["healthcheck"]
    assert check["test"][:4] == ["CMD", "python", "-m", "services.common.grpc_server"]
    assert check["test"][-1] == "rollout" and "--registered" not in check["test"] and \
        "configs/rl_tiny.yaml" in check["test"]
    assert {k: check[k] for k in ("interval", "timeout", "retries")} == \
        {k: compose["dataloader"]["healthcheck"][k] for k in ("interval", "timeout", "retries")}


def rollout_probe(run: str) -> subprocess.CompletedProcess:
    """The rollout service's health check command, against the shared test Redis."""
    test = services()["rollout"]["healthcheck"]["test"]
    env = {**os.environ, "REDIS_URL": "redis://127.0.0.1:6379"}
    return subprocess.run([sys.executable, *test[2:], f"run.name={run}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


def test_rollout_health_check_passes_while_every_registered_worker_answers_grpc_health():
    run = f"probe-{uuid.uuid4().hex[:8]}"
    assert rollout_probe(run).returncode == 1
    registry = Registry("redis://127.0.0.1:6379", run)
    other = registry.register("dataloader", {"grpc": "127.0.0.1:1"})
    server, port = grpc_server.serve()  # a worker's health service
    heartbeat = None
    try:
        assert rollout_probe(run).returncode == 1  # another service's record is not a worker
        heartbeat = registry.register("rollout", {"stream": "s", "worker": "worker0", "grpc": f"127.0.0.1:{port}"},
                                      instance="worker0")
        res = rollout_probe(run)
        assert res.returncode == 0, res.stderr
        grpc_server.stop(server, grace=0)  # registered but not answering (hung, or dead within its heartbeat's TTL)
        res = rollout_probe(run)
        assert res.returncode == 1 and "not SERVING" in res.stderr
        heartbeat.stop()  # a stopped (or, after its TTL, a dead) worker's record is gone
        assert rollout_probe(run).returncode == 1
    finally:
        grpc_server.stop(server, grace=0)
        if heartbeat is not None:
            heartbeat.stop()
        other.stop()


def test_rollout_workers_only_run_with_the_rl_profile():
    compose = services()
    assert compose["rollout"]["profiles"] == compose["rl_trainer"]["profiles"] == ["rl"]
    assert all("profiles" not in s for name, s in compose.items() if name not in ("rollout", "rl_trainer"))


def test_runs_live_in_a_named_volume():
    doc = yaml.safe_load(COMPOSE.read_text())
    assert "runs" in doc["volumes"]
    assert "runs:/app/runs" in services()["trainer"]["volumes"]


def probe(service: str, run: str) -> subprocess.CompletedProcess:
    """The command the compose health checks run, against the shared test Redis."""
    env = {**os.environ, "REDIS_URL": "redis://127.0.0.1:6379"}
    return subprocess.run([sys.executable, "-m", "services.common.grpc_server", service, f"run.name={run}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_health_probe_passes_for_a_registered_serving_service_and_fails_otherwise():
    run = f"probe-{uuid.uuid4().hex[:8]}"
    res = probe("dataloader", run)
    assert res.returncode == 1
    assert f"no 'dataloader' registered in run '{run}'" in res.stderr
    server, port = grpc_server.serve()
    heartbeat = Registry("redis://127.0.0.1:6379", run).register("dataloader", {"grpc": f"127.0.0.1:{port}"})
    try:
        res = probe("dataloader", run)
        assert res.returncode == 0, res.stderr
        server.stop(0).wait()
        res = probe("dataloader", run)
        assert res.returncode == 1 and f"127.0.0.1:{port} is not SERVING" in res.stderr
    finally:
        heartbeat.stop()
        server.stop(0)


def _docker_compose() -> str:
    exe = shutil.which("docker-compose")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose is not installed; .ci/run installs it (apt-get install docker-compose)")
        pytest.skip("docker-compose is not installed (apt-get install docker-compose); CI runs this check")
    return exe


@pytest.mark.parametrize("profile", [[], ["--profile", "rl"]], ids=["default", "rl"])
def test_docker_compose_accepts_the_file(profile):
    res = subprocess.run([_docker_compose(), "-f", str(COMPOSE), *profile, "config", "--quiet"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def test_docker_compose_rejects_a_broken_file(tmp_path):
    # The validation above means something only if the validator refuses a wrong file.
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE.read_text().replace("condition: service_healthy", "condition: when_it_feels_like_it", 1))
    res = subprocess.run([_docker_compose(), "-f", str(broken), "config", "--quiet"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
