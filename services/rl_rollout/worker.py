"""The rollout worker: pulls policy weights, generates groups of samples per prompt, scores them, publishes the groups.

    python -m services.rl_rollout.worker --config FILE [--worker-id ID] [section.key=value ...]

Registers itself at once as service "rollout" with {"stream": <Redis stream key>, "worker": <id>, "grpc": <address of its
RolloutControl service (Status) and the standard gRPC health service, what the launcher, compose and `foldmoe status`
probe>, "metrics": <Prometheus endpoint>} (services/common/metrics.py: tokens/s, reward, weights version, staleness).
Its id is `--worker-id`, or
else "worker<i>" for the lowest of the `rl.workers` slots no live worker holds (claimed atomically in Redis), so the
launcher's and compose's workers get stable ids, and with them reproducible prompts and samples (the launcher waits
for that before it starts the trainer, and the trainer learns the stream from it), then loops until SIGTERM/SIGINT:
refresh weights from the trainer's publisher (registry service "rl_weights", record {"zmq": endpoint}; bounded
staleness, `weights.PolicyWeights`) -> wait, pulling newer weights, while the steps that could train on groups of
these weights already have theirs waiting in the stream (`room`) -> generate `rl.prompts_per_batch` prompts x
`rl.group_size` samples with one engine batch -> publish each group (XADD) as soon as its last sample finishes. Every
group records the weights version that generated it. Several workers may run at once; a worker that dies loses only
the groups it had not finished, and a restarted one starts from the trainer's current weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from proto import rollout_pb2, rollout_pb2_grpc
from services.common import grpc_server, logs, net, procs, rollout_stream
from services.common.config import Config, ConfigError, ModelConfig, load_config
from services.common.metrics import RolloutMetrics
from services.common.registry import Registry, RegistryError, redis_url
from services.common.tokenizer import load_tokenizer
from services.rl_rollout.engine import Completion, Engine, Request
from services.rl_rollout.publish import TrajectoryStream, encode_group
from services.rl_rollout.rewards import get_task
from services.rl_rollout.sampling import SamplingParams
from services.rl_rollout.weights import PolicyWeights
from services.trainer.model.transformer import MoETransformer

log = logs.logger("rollout")


@dataclass
class _Pending:
    prompt: str
    meta: dict
    done: list[Completion | None] = field(default_factory=list)


def rollout_model_config(model: ModelConfig) -> ModelConfig:
    """The worker's model: the trainer's, dropless. A capacity drops by the tokens an expert shares a forward with;
    decode batches (one token of each running sequence) are not the trainer's micro-batches, so the rollout keeps every
    slot and the trainer, replaying its ids, drops by its own micro-batches (rl/step.py); the train/rollout log-prob
    mismatch metrics show the difference."""
    return dataclasses.replace(model, capacity_factor=0.0, pad_to_capacity=False)


def rollout_device(cfg: Config) -> torch.device:
    if cfg.run.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("`run.device=cuda` but no CUDA device is visible; use run.device=cpu or auto")
    return torch.device("cuda" if cfg.run.device != "cpu" and torch.cuda.is_available() else "cpu")


class RolloutControl(rollout_pb2_grpc.RolloutControlServicer):
    """The worker's gRPC control service: what it generates with and how much it has published."""

    def __init__(self, worker: RolloutWorker):
        self.worker = worker

    def Status(self, request, context):
        w = self.worker
        policy = getattr(w, "policy", None)  # None while the worker is still being built
        return rollout_pb2.RolloutStatus(worker=getattr(w, "worker_id", ""),
                                         weights_version=policy.version if policy else -1,
                                         newest_version_seen=policy.latest_seen if policy else -1,
                                         groups_published=w.groups_published, tokens_generated=w.tokens_generated)


class RolloutWorker:
    def __init__(self, cfg: Config, registry: Registry, worker_id: str | None = None,
                 stop: threading.Event | None = None):
        self.cfg, self.registry = cfg, registry
        self.stop = stop or threading.Event()
        rl = cfg.rl
        self.task = get_task(rl.task)  # KeyError names the registered tasks
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        if self.tokenizer.vocab_size > cfg.model.vocab_size:
            raise ConfigError(f"tokenizer has {self.tokenizer.vocab_size} ids but `model.vocab_size={cfg.model.vocab_size}`")
        self.groups_published = self.tokens_generated = self._reserved = 0
        self.stream = TrajectoryStream(registry.url, registry.run)
        self.metrics = RolloutMetrics().serve(cfg.run.bind_host, advertise=cfg.run.advertise_host)
        self._grpc, port = grpc_server.serve(
            [lambda s: rollout_pb2_grpc.add_RolloutControlServicer_to_server(RolloutControl(self), s)],
            ["foldmoe.v1.RolloutControl"], host=cfg.run.bind_host, max_workers=2, token=net.auth_token())
        try:
            self._build(registry, worker_id, port)
        except BaseException:  # nothing half-built outlives a failed start (a registration would look alive)
            if hasattr(self, "_heartbeat"):
                self._heartbeat.stop()
            grpc_server.stop(self._grpc, grace=0)
            self.metrics.close()
            self.stream.close()
            raise

    def _build(self, registry: Registry, worker_id: str | None, port: int) -> None:
        cfg, rl = self.cfg, self.cfg.rl
        info = {"stream": self.stream.key, "metrics": self.metrics.endpoint,
                "grpc": f"{net.advertised(cfg.run.bind_host, cfg.run.advertise_host)}:{port}"}
        if worker_id is None:  # the lowest free of `rl.workers` slots: "worker0", "worker1", ... (launcher and compose)
            index, self._heartbeat = registry.claim("rollout", rl.workers, info)
            worker_id = f"worker{index}"
            self._heartbeat.update(worker=worker_id)
        else:
            self._heartbeat = registry.register("rollout", {**info, "worker": worker_id}, instance=worker_id)
        self.worker_id = worker_id
        # Prompts and samples are drawn from `run.seed` and the worker id alone: a worker started again under the same
        # id asks the same questions in the same order; workers with different ids ask different ones and sample apart.
        self.rng = random.Random(f"{cfg.run.seed}:{self.worker_id}")
        self.device = rollout_device(cfg)
        # bf16 on GPU is the rollout precision; CPU runs fp32 (as training does there).
        dtype = torch.bfloat16 if self.device.type == "cuda" and cfg.run.dtype == "bf16" else torch.float32
        self.model = MoETransformer(rollout_model_config(cfg.model)).to(device=self.device, dtype=dtype).eval()
        self.engine = Engine(self.model, self.tokenizer, rl.max_batch, rl.max_seq_len,
                             seed=random.Random(f"{cfg.run.seed}:{self.worker_id}:sampling").getrandbits(63),
                             cuda_graphs=rl.cuda_graphs)
        self.params = SamplingParams(temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k,
                                     max_tokens=rl.max_new_tokens, stop=tuple(rl.stop))
        self.policy = PolicyWeights(self.model, None, rl.max_staleness, locate=self._publisher, stop=self.stop)

    def room(self) -> int:
        """How many more groups made now with our weights the trainer will read (`rollout_stream.room`): none once the
        groups waiting in the stream fill every step that can still train on ours (step s trains on versions
        s - `rl.max_staleness` .. s), or `rl.max_queued_groups` wait that the next step could use (counting stale
        ones would stop the workers while the dataloader waits for fresh groups: the run would stall). More would
        only go stale (`dropped_stale`), generated on GPU time the trainer may share; meanwhile `run` keeps pulling
        newer weights, which open room. The groups other workers have reserved and not published yet count as
        waiting."""
        rl = self.cfg.rl
        waiting, next_step = self.stream.waiting(rl.max_queued_groups, rl.max_staleness)
        waiting += self._reserved_by_others()  # published after those waiting
        oldest = -1 if next_step is None else next_step - rl.max_staleness
        if sum(v >= oldest for v in waiting) >= rl.max_queued_groups:  # stale ones never hold a worker back
            return 0
        version = self.policy.version
        return rollout_stream.room(waiting, version if next_step is None else next_step, version, rl.max_staleness,
                                   rl.groups_per_step)

    def _publisher(self) -> str | None:
        """The newest trainer's weight endpoint (a dead trainer's record outlives it by at most the heartbeat TTL)."""
        records = [r for r in self.registry.lookup("rl_weights") if r.get("zmq")]
        return max(records, key=lambda r: r.get("started", 0))["zmq"] if records else None

    def _reserved_by_others(self) -> list[int]:
        """The versions of the groups other live workers have reserved and not published yet (their registry records'
        "reserved" field; a dead worker's record, and with it its reservation, expires with its heartbeat)."""
        versions = []
        for record in self.registry.lookup("rollout"):
            if record.get("worker") != self.worker_id and record.get("reserved"):
                version, groups = record["reserved"]
                versions += [version] * groups
        return versions

    def _reserve(self, groups: int) -> None:
        """Record in our registry record how many groups of our weights' version we are generating (0: none)."""
        self._reserved = groups
        self._heartbeat.update(reserved=[self.policy.version, groups] if groups else None)

    def run(self, max_groups: int | None = None) -> None:
        while not self.stop.is_set() and (max_groups is None or self.groups_published < max_groups):
            # The newest weights first, then the throttle for them: the room left depends on the weights' version
            # (services/common/rollout_stream.py). One worker decides at a time, reserving what it takes.
            while True:
                if not self.policy.refresh():
                    return
                with rollout_stream.deciding(self.stream.client, self.stream.key):
                    groups = min(self.room(), self.cfg.rl.prompts_per_batch)
                    if groups > 0:
                        self._reserve(groups)
                if groups > 0:
                    break
                if self.stop.wait(0.1):
                    return
            try:
                self.run_batch(groups)
            finally:
                self._reserve(0)

    def run_batch(self, prompts: int | None = None) -> None:
        """Generate `prompts` (default `rl.prompts_per_batch`) prompts' groups in one engine batch, publishing each
        group as it completes."""
        rl, version = self.cfg.rl, self.policy.version
        pending = self.next_prompts(prompts or rl.prompts_per_batch)
        requests = []
        for g, p in enumerate(pending):
            p.done = [None] * rl.group_size
            requests += [Request(self.tokenizer.encode(p.prompt), self.params, tag=(g, i)) for i in range(rl.group_size)]
        t0 = time.perf_counter()
        rewards: list[float] = []

        def complete(c: Completion) -> None:
            g, i = c.tag
            group = pending[g]
            group.done[i] = c
            if all(d is not None for d in group.done):
                rewards.extend(self._publish(group, version))

        completions = self.engine.generate(requests, on_complete=complete)
        tokens, seconds = sum(len(c.tokens) for c in completions), time.perf_counter() - t0
        self.tokens_generated += tokens
        self.metrics.batch(tokens, seconds, rewards, len(pending), version, self.policy.behind())
        log.info("version %d: %d groups, %d tokens in %.2fs, mean reward %.3f", version, len(pending), tokens,
                 seconds, sum(rewards) / max(1, len(rewards)))

    def next_prompts(self, count: int | None = None) -> list[_Pending]:
        """The next `count` (default `rl.prompts_per_batch`) prompts (and their reward metadata)."""
        return [_Pending(*self.task.make_prompt(self.rng, self.cfg.rl.difficulty))
                for _ in range(count or self.cfg.rl.prompts_per_batch)]

    def _publish(self, group: _Pending, version: int) -> list[float]:
        rewards = [float(self.task.reward(group.prompt, c.text, group.meta)) for c in group.done]
        msg = encode_group(f"{self.worker_id}:{self.groups_published}", self.worker_id, version, self.task.name,
                           group.prompt, group.meta, self.params.temperature, group.done, rewards)
        self.stream.publish(msg)
        self.groups_published += 1
        if self._reserved > 0:
            self._reserve(self._reserved - 1)
        return rewards

    def close(self) -> None:
        self._heartbeat.stop()
        grpc_server.stop(self._grpc, grace=0.5)
        self.metrics.close()
        self.engine.close()
        self.policy.close()
        self.stream.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.rl_rollout.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML config file")
    parser.add_argument("--worker-id", default=None,
                        help="stable id (registry instance, group ids, prompt and sampling seeds); default: "
                             "worker<i>, the lowest free of the rl.workers slots")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args(argv)
    logs.configure("rollout")
    stop = threading.Event()
    try:
        procs.stop_on_signals(stop)  # first: a malformed stop grace fails before anything is started
        cfg = load_config(args.config, args.overrides)
        worker = RolloutWorker(cfg, Registry(redis_url(), cfg.run.name), args.worker_id, stop=stop)
    except (ValueError, RegistryError, KeyError) as e:  # ConfigError is a ValueError; KeyError: an unknown rl.task
        print(f"rollout: error: {e}", file=sys.stderr)
        return 2
    try:
        worker.run()
    finally:
        worker.close()
    log.info("stopped after %d groups", worker.groups_published)
    return 0


if __name__ == "__main__":
    sys.exit(main())
