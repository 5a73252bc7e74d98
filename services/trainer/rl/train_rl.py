"""RL trainer entry point: `torchrun ... -m services.trainer.rl.train_rl --config FILE [section.key=value ...]`.

`foldmoe train` starts it instead of `services.trainer.train` when `rl.enabled`. The loop is the pre-training loop's
(runtime, registry, model, AdamW with its schedule, checkpointer service, per-step record and progress line, all reused
from services/trainer/train.py and friends) with the data and the step swapped:

    publish weights v0 ─▶ workers generate ─▶ stream ─▶ read groups (fresh enough for v_s) ─▶ rl_step ─▶ publish v_{s+1}

Versions count optimizer steps: the weights after s steps are version s, so a checkpoint of step s holds version s and
a resumed trainer publishes from there. Data comes from the rollout stream through `rollouts.RolloutReader` (its module
docstring says why not through the dataloader).

`run.nproc=N` ranks train on a folded layout: data parallel, with `parallel.tp` (sequence parallel), `ep` and `etp` as
in pre-training; pp and cp are refused (`validate_rl`, rl/folded.py says why). Rank 0 alone reads the stream and
broadcasts each step's groups (`shared.py`); each DP replica trains on its share and the pre-training
DistributedOptimizer reduces the gradients (`step.py`); every rank sends its shards of the updated weights to rank 0
(`parallel/gather_weights.py`: full tensors, in the sync dtype, one at a time), which alone publishes them; every rank
takes part in checkpoint saves, as in pre-training.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from redis import RedisError

from services.common.config import Config, ConfigError, load_config
from services.common.registry import Registry, RegistryError, redis_url
from services.trainer import checkpointing
from services.trainer.metrics import MetricsLog
from services.trainer.model.transformer import MoETransformer
from services.trainer.optim import build_adamw, lr_at, set_lr
from services.trainer.parallel.expert_parallel import sync_expert_load
from services.trainer.parallel.gather_weights import WeightGather
from services.trainer.parallel.groups import ParallelGroups, init_groups
from services.trainer.parallel.parallelize import build_optimizer, parallelize
from services.trainer.progress import StepPrinter
from services.trainer.rl.folded import frozen_copy
from services.trainer.rl.rollouts import RolloutReader
from services.trainer.rl.shared import SharedRollouts
from services.trainer.rl.step import rl_step
from services.trainer.rl.weight_publisher import WeightPublisher, sync_dtype
from services.trainer.train import init_runtime, seed_everything, update_router_bias


def validate_rl(cfg: Config) -> None:
    """What an RL run needs beyond `config.validate`; the CLI calls it before starting any process."""
    rl, p = cfg.rl, cfg.parallel
    if p.pp > 1:
        raise ConfigError(f"RL training does not run pipeline parallel (`parallel.pp={p.pp}`): the policy loss is not "
                          "part of the pipeline schedule (rl/folded.py); set `parallel.pp=1` and shard with "
                          "`parallel.tp`, `ep`, `etp` and data parallelism")
    if p.cp > 1 or any(c > 1 for c in p.cp_sizes):
        raise ConfigError(f"RL training does not run context parallel (`parallel.cp={p.cp}`, `cp_sizes={p.cp_sizes}`): "
                          "per-token log-probs are read on whole sequences (rl/folded.py); set `parallel.cp=1` and "
                          "`parallel.cp_sizes=[]`")
    dp = cfg.run.nproc // (p.tp * p.cp * p.pp)  # the data-parallel replicas; each trains on whole groups
    if rl.workers < 1:
        raise ConfigError(f"`rl.workers` must be at least 1 in an RL run, got {rl.workers}")
    if rl.group_size < 2:
        raise ConfigError(f"`rl.group_size={rl.group_size}`: GRPO needs at least 2 samples per prompt, otherwise "
                          "every advantage is zero")
    if rl.groups_per_step < 1 or rl.rollout_timeout_s <= 0:
        raise ConfigError("`rl.groups_per_step` and `rl.rollout_timeout_s` must be positive")
    if rl.groups_per_step < dp:
        raise ConfigError(f"`rl.groups_per_step={rl.groups_per_step}` is fewer than the {dp} data-parallel replicas "
                          f"(`run.nproc={cfg.run.nproc}` / tp*cp*pp): each replica trains on whole groups, so some "
                          "would have none")
    if cfg.model.capacity_factor > 0:
        raise ConfigError(f"RL needs a dropless MoE (`model.capacity_factor=0`, got {cfg.model.capacity_factor}): "
                          "routing replay cannot reproduce batch-dependent token drops")


class RLStepPrinter(StepPrinter):
    """The pre-training progress line with RL's numbers: reward, response length, clip fraction, KL to the reference,
    train/rollout log-prob mismatch and how stale the step's trajectories were."""

    def rl_header(self, cfg: Config, device: torch.device, start_step: int, stream: str) -> None:
        if self.enabled:
            where = f"resuming at step {start_step}" if start_step else "from scratch"
            self.console.print(f"trainer: RL run {cfg.run.name} on {device}, {cfg.run.steps} steps {where}; task "
                               f"{cfg.rl.task}, {cfg.rl.groups_per_step} groups x {cfg.rl.group_size} samples per "
                               f"step from {stream}")

    def step(self, r: dict) -> None:
        if not self.enabled:
            return
        step = r["step"]
        eta = (time.perf_counter() - self.t0) / max(step - self.start, 1) * (self.total - step)
        self.console.print(
            f"step {step:>5}/{self.total} {self._bar(step)} reward {r['reward']:.3f} len {r['response_length']:.1f} "
            f"clip {100 * r['clip_frac']:.1f}% kl {r['kl']:.4f} mismatch {r['logprob_mismatch']:.4f} "
            f"stale {r['staleness_max']} (v{min(r['policy_versions'])}-{max(r['policy_versions'])}) "
            f"loss {r['loss']:+.4f} gnorm {r['grad_norm']:.2f} wait {1000 * r['rollout_wait_s']:.0f}ms "
            f"({100 * r['rollout_wait_frac']:.0f}% of the step) eta {eta:.0f}s")


def reference_model(model: MoETransformer, cfg: Config, groups: ParallelGroups | None = None
                    ) -> MoETransformer | None:
    """A frozen copy of the initial policy for the KL term (only with `rl.kl_coef > 0`): `checkpoint.init_from`'s
    weights when set, else the seeded random init. Taken before a resume restores later weights: the reference is the
    starting policy, whichever step the run resumes at. `groups`: the layout `model` is parallelized on."""
    if cfg.rl.kl_coef <= 0:
        return None
    return frozen_copy(model, groups)  # a parallelized model's process groups stay shared


def train_rl(cfg: Config) -> int:
    validate_rl(cfg)
    rt = init_runtime(cfg)
    seed_everything(cfg.run.seed)
    registry = Registry(redis_url(), cfg.run.name)
    groups = init_groups(cfg, rt.world_size, rt.rank)
    parallel = rt.world_size > 1  # one rank keeps torch's AdamW; several sum gradients in the distributed optimizer
    lead = rt.rank == 0  # reads the stream, publishes weights, prints and logs
    model = MoETransformer(cfg.model)
    model.init_weights(cfg.run.seed)
    # checkpoint.init_from's weights (e.g. a pre-trained model); with a KL term even when resuming, since the reference
    # is the starting policy (a resume then overwrites the policy's weights)
    checkpointing.init_from(cfg, model, rt.rank, force=cfg.rl.kl_coef > 0)
    if parallel:
        parallelize(model, cfg, groups)  # the folded layout validate_rl accepts
    model.to(rt.device)
    # before the optimizer: the distributed one makes parameters views of its buckets
    ref = reference_model(model, cfg, groups)
    optimizer = build_optimizer(model, cfg, groups) if parallel else build_adamw(model, cfg.optimizer)
    shard_groups = groups if parallel else None  # checkpoints name each rank's pieces as in pre-training

    reader = RolloutReader.from_registry(registry, cfg.rl.max_staleness, timeout=cfg.rl.rollout_timeout_s) \
        if lead else None
    rollouts = SharedRollouts(reader, rt.device)
    saver = checkpointing.connect(registry, cfg, rt.rank, rt.world_size)
    try:
        start_step = checkpointing.restore(cfg, model, optimizer, rollouts, rt.rank, shard_groups)
    except ValueError as e:
        raise checkpointing.CheckpointLoadError(str(e)) from None
    rollouts.discard_backlog()  # before the first publish: whatever is there was generated for another incarnation
    publisher, beat = None, None
    gather = WeightGather(model, groups)  # every rank sends its shards; rank 0 gets full tensors
    if lead:
        publisher = WeightPublisher.from_config(cfg.rl, cfg.run.bind_host, cfg.run.advertise_host).start()
    publish(publisher, gather, start_step, sync_dtype(cfg.rl))
    if lead:
        beat = registry.register("rl_weights", {"zmq": publisher.endpoint})
    printer = RLStepPrinter(cfg.run.steps, start_step, enabled=lead)
    log = MetricsLog(cfg.run.metrics_file if lead else None)
    printer.rl_header(cfg, rt.device, start_step, rollouts.stream)
    try:
        for step in range(start_step, cfg.run.steps):
            t0 = time.perf_counter()
            step_groups = rollouts.next_groups(cfg.rl.groups_per_step, step, timeout_s=cfg.rl.rollout_timeout_s)
            wait = time.perf_counter() - t0
            lr = lr_at(step, cfg.optimizer, cfg.run.steps)
            if not parallel:
                set_lr(optimizer, lr)
            metrics = rl_step(model, optimizer, step_groups, cfg.rl, rt.device, cfg.optimizer.clip_grad, ref,
                              rt.autocast_dtype, version=step, lr=lr)
            if parallel:
                sync_expert_load(model, groups)  # the bias update sees the global load, identically on every rank
            load = update_router_bias(model, cfg, groups.dp.size)  # the bias moves the rollout's routing: policy
            publish(publisher, gather, step + 1, sync_dtype(cfg.rl))  # collective: every rank sends its shards
            stall = checkpointing.save(saver, cfg, model, optimizer, rollouts, step + 1, shard_groups) \
                if checkpointing.due(cfg, step + 1) else 0.0
            step_time = time.perf_counter() - t0
            wait, step_time = _mean_over_ranks([wait, step_time], rt.device) if parallel else (wait, step_time)
            # the share of the step the trainer sat idle waiting for trajectories: near 1, rollout is the bottleneck
            # (add workers); near 0, the trainer is (the workers wait on the backlog bound)
            record = {"step": step + 1, **metrics, "lr": lr, "step_time_s": step_time, "rollout_wait_s": wait,
                      "rollout_wait_frac": wait / step_time if step_time > 0 else 0.0, "ckpt_stall_s": stall,
                      "max_load_ratio": load["max_ratio"], "dropped_stale": rollouts.dropped_stale,
                      "dropped_foreign": rollouts.dropped_foreign, "groups": len(step_groups),
                      "trainer_ranks": rt.world_size}
            log.write(record)
            printer.step(record)
            if lead:
                registry.set_state("step", step + 1)
        saver.wait()
    finally:
        if beat is not None:
            beat.stop()
        if publisher is not None:
            publisher.stop()
        saver.close()
        log.close()
        rollouts.close()
    printer.done()
    return 0


def publish(publisher: WeightPublisher | None, gather: WeightGather, version: int, dtype: torch.dtype) -> None:
    """Version `version` of the full weights, cast to `dtype` before they travel, to the rank holding the publisher
    (collective: every rank must call it)."""
    state = gather.state_dict(dtype)
    if publisher is not None:
        publisher.publish(version, state)


def _mean_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Every rank waits for the same read (rank 0's, then the broadcast): the mean is the trainer's wait."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return (t / torch.distributed.get_world_size()).tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="services.trainer.rl.train_rl", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=None, help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        return train_rl(cfg)
    except (ConfigError, RegistryError, checkpointing.CheckpointLoadError) as e:
        print(f"trainer: error: {e}", file=sys.stderr)
        return 2
    except (TimeoutError, RedisError) as e:
        print(f"trainer: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
