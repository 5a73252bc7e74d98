"""Trainer rank entry point: `torchrun ... -m services.trainer.train --config FILE [section.key=value ...]`.

The trainer does compute only. It finds the dataloader and checkpointer through the Redis registry, pulls each step's
micro-batches, runs forward/backward/step, and hands state to the checkpointer, which writes it while training goes on.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from redis import RedisError

from services.checkpointer.handoff import SaveError
from services.common import logs
from services.common.config import Config, ConfigError, load_config, validate
from services.common.metrics import TrainerMetrics
from services.common.registry import Registry, RegistryError, redis_url
from services.dataloader.errors import DataError
from services.trainer import checkpointing
from services.trainer.evaluate import EvalResult, evaluate
from services.trainer.metrics import (MetricsLog, StepEnd, StepValues, TrainingDiverged, check_finite, datasheet_peak,
                                      flops_per_token, measure_peak_tflops)
from services.trainer.model.mtp import mean_per_target
from services.trainer.model.initial_weights import SeededInit, materialize, parameters_on_meta
from services.trainer.model.recompute import apply_memory_policy
from services.trainer.model.transformer import MoETransformer
from services.trainer.optim import build_adamw, clip_and_step, lr_at, set_lr
from services.trainer.parallel.checkpoint_shards import read_local
from services.trainer.parallel.expert_parallel import sync_expert_load
from services.trainer.parallel.groups import ParallelGroups, init_groups, sum_over
from services.trainer.parallel.parallelize import build_optimizer, forward_backward_parallel, parallelize
from services.trainer.profiling import StepProfiler
from services.trainer.progress import StepPrinter
from services.trainer.step import count_loss_tokens, forward_backward


# Steps the host may queue ahead of the last one it reported while a checkpoint's device-to-host copies run: their
# values come back only after those copies (services/trainer/metrics.py StepValues), and waiting for them would leave
# the device without work.
MAX_UNREPORTED = 16


@dataclass
class Runtime:
    rank: int
    world_size: int
    device: torch.device
    autocast_dtype: torch.dtype | None


def world_size_from_env() -> int:
    """The ranks of this trainer as torchrun (or compose) started them; `run.nproc` is only how many `foldmoe train`
    asks torchrun for."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_runtime(cfg: Config) -> Runtime:
    world_size = world_size_from_env()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    want_cuda = cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
    if cfg.run.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("`run.device=cuda` but no CUDA device is visible; use run.device=cpu or auto")
    if want_cuda and local_rank >= (gpus := torch.cuda.device_count()):  # else set_device: "invalid device ordinal"
        raise ConfigError(f"rank {rank} needs GPU {local_rank} (LOCAL_RANK={local_rank}), but only {gpus} CUDA "
                          f"device(s) are visible: start at most {gpus} ranks per machine "
                          f"(`run.nproc={cfg.run.nproc}`) or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    device = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
    if want_cuda:
        torch.cuda.set_device(device)
    if world_size > 1:
        torch.distributed.init_process_group("nccl" if want_cuda else "gloo", device_id=device if want_cuda else None)
    validate(cfg, world_size)
    # bf16 autocast on the GPU; on the CPU only with bf16 parameters (their fp32 embedding and norms meet bf16 matrices)
    bf16_params = cfg.optimizer.param_dtype == "bf16"
    autocast = torch.bfloat16 if cfg.run.dtype == "bf16" and (want_cuda or bf16_params) else None
    return Runtime(rank, world_size, device, autocast)


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def build_model(cfg: Config, rt: Runtime, groups: ParallelGroups, force_init: bool = False,
                source: checkpointing.CheckpointSource | None = None) -> MoETransformer:
    """This rank's model on its device, and no more of it: built with its parameters on the meta device, cut to this
    rank's slices of the folded layout, then each slice gets device memory and its values: `checkpoint.init_from`'s,
    unless a resume (from `source`, see `checkpointing.restore`) will overwrite them (`force_init`: load them anyway),
    else the seeded initial weights (model/initial_weights.py: what a single process starts from, whatever the layout;
    the rank draws only the blocks of rows its boxes touch, on all cores). Those are drawn only when nothing will be
    loaded over them: a rank's share of tens of billions of parameters is still billions of random numbers. A resume
    loads after the optimizer exists, so until then the values of a resuming model are undefined (`force_init`: the RL
    reference policy copies the model first and draws when there is no init_from). The memory policy is the caller's
    to apply, last (it wraps the cores parallelize swapped in; RL copies its reference model first)."""
    model, shapes = model_slices(cfg, rt, groups)
    resuming = None if force_init else checkpointing.resumable(cfg, source)  # one manifest scan, for both questions
    loaded = checkpointing.init_from(cfg, model, rt.rank, resuming, groups, shapes)
    if loaded is None and resuming is None:
        init = SeededInit(cfg.model, cfg.run.seed, shapes)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(read_local(init, name, p, groups))
    return model


def model_slices(cfg: Config, rt: Runtime,
                 groups: ParallelGroups) -> tuple[MoETransformer, dict[str, tuple[int, ...]]]:
    """(this rank's slices of `cfg.model` on its device, their values undefined; the whole model's state shapes, name
    -> shape, as a checkpoint holds them): built on the meta device and cut to the layout before any memory is taken."""
    with parameters_on_meta():
        model = MoETransformer(cfg.model)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if rt.world_size > 1:
        parallelize(model, cfg, groups)
    materialize(model, rt.device)
    model.to(rt.device)  # the buffers
    return model, shapes


def apply_model_memory_policy(model: MoETransformer, cfg: Config) -> None:
    m = cfg.model
    apply_memory_policy(model, m.recompute, m.offload, m.recompute_layers, m.offload_layers)


def build_rank_optimizer(model: MoETransformer, cfg: Config, groups: ParallelGroups):
    """One rank keeps torch's AdamW and the plain step; several run the distributed optimizer of the folded layout."""
    return build_optimizer(model, cfg, groups) if groups.world.size > 1 else build_adamw(model, cfg.optimizer)


def train_step(model: MoETransformer, optimizer, micro_batches: list, lr: float, cfg: Config, rt: Runtime,
               groups: ParallelGroups) -> StepValues:
    """One optimizer step over the step's micro-batches, queued on the device; its values are read at its report."""
    if rt.world_size > 1:
        optimizer.zero_grad()
        # the token count stays on the device (the divisor of the step's loss): read with the step's values
        loss_sum, step_tokens = forward_backward_parallel(model, micro_batches, groups, cfg, rt.device,
                                                          rt.autocast_dtype, optimizer)
        grad_norm = optimizer.step(lr)
        sync_expert_load(model, groups)  # the bias update sees the global load, identically on every rank
    else:
        set_lr(optimizer, lr)
        step_tokens = count_loss_tokens(micro_batches)
        optimizer.zero_grad(set_to_none=True)
        # max: a step of prompts alone (prompt/completion data) has no target; its loss is 0, not a division by 0
        loss_sum = forward_backward(model, micro_batches, max(step_tokens, 1), rt.device, rt.autocast_dtype)
        grad_norm = clip_and_step(optimizer, model.parameters(), cfg.optimizer.clip_grad)
    mtp = {"mtp_loss": mtp_loss_of_step(model, groups, rt.device)} if cfg.model.mtp_num_layers else {}
    return StepValues(loss_sum=loss_sum, step_tokens=torch.as_tensor(step_tokens), grad_norm=torch.as_tensor(grad_norm),
                      aux_loss=sum((m.last_aux_loss for m in model.moe_layers()), torch.zeros(())),
                      loads=advance_router_bias(model, cfg), **mtp)


def loss_and_norm(values: dict[str, torch.Tensor]) -> tuple[float, float]:
    """A step's mean token loss and gradient norm from its values on the host (`StepValues.read`)."""
    return float(values["loss_sum"]) / max(int(values["step_tokens"]), 1), float(values["grad_norm"])


def evaluation_due(cfg: Config, step: int) -> bool:
    """Whether the held-out loss is measured after `step` (1-based): every `run.eval_interval` steps and after the
    last."""
    every = cfg.run.eval_interval
    return bool(every) and (step % every == 0 or step == cfg.run.steps)


def mtp_loss_of_step(model: MoETransformer, groups: ParallelGroups, device: torch.device) -> torch.Tensor:
    """The MTP depths' mean cross-entropy per target token over the step's micro-batches on every DP x CP rank, from
    the last pipeline stage (which holds the depths; the others add zeros), queued on the device (mtp.py)."""
    return mean_per_target(sum_over(model.mtp_loss_sums.take(device), groups.dp_cp, groups.pp))


class StepReporter:
    """Each step's record, written once its values are on the host: the metrics file and progress line (rank 0), the
    Prometheus exporter, and the run state's step (rank 0)."""

    def __init__(self, cfg: Config, rt: Runtime, groups: ParallelGroups, registry: Registry,
                 exporter: TrainerMetrics, start_step: int):
        self.cfg, self.rt, self.dp, self.registry, self.exporter = cfg, rt, groups.dp.size, registry, exporter
        self.tokens_per_step = cfg.data.micro_batch_size * cfg.data.seq_len * cfg.data.grad_accum * self.dp
        self.flops_tok = flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak_sheet = cfg.run.peak_tflops or datasheet_peak(rt.device)
        dtype = rt.autocast_dtype or torch.float32
        self.peak_measured = measure_peak_tflops(rt.device, dtype) if rt.rank == 0 else 0.0
        self.printer = StepPrinter(cfg.run.steps, start_step, enabled=rt.rank == 0)
        self.log = MetricsLog(cfg.run.metrics_file if rt.rank == 0 else None)
        self.printer.header(cfg, rt.device, self.peak_sheet, self.peak_measured, start_step)
        self.evaluations: dict[int, dict] = {}  # step -> its evaluation's fields, added to the step's record

    def evaluated(self, step: int, result: EvalResult, seconds: float) -> None:
        """The held-out loss measured after `step` (1-based) in `seconds` (its data's transfer included): written with
        the step's record."""
        fields = {"eval_loss": result.loss, "eval_tokens": result.tokens, "eval_time_s": seconds}
        if result.mtp_loss is not None:
            fields["eval_mtp_loss"] = result.mtp_loss
        self.evaluations[step] = fields

    def __call__(self, step: int, values: StepValues, end: StepEnd, lr: float, data_wait: float, stall: float,
                 since: StepEnd) -> StepEnd:
        """Step's record; `since`: the previous step's end. Returns `end`."""
        v = values.read()
        loss, grad_norm = loss_and_norm(v)
        end.wait()
        dt = end.seconds_since(since)
        tps = self.tokens_per_step / dt
        per_rank_tflops = tps * self.flops_tok / 1e12 / self.rt.world_size
        load = expert_load_summary(v["loads"], self.cfg, self.dp)
        record = {
            "step": step + 1, "loss": loss, "grad_norm": grad_norm,
            "lr": lr, "tokens_per_s": tps, "step_time_s": dt, "data_wait_s": data_wait, "ckpt_stall_s": stall,
            "aux_loss": float(v["aux_loss"]),
            "mfu": per_rank_tflops / self.peak_sheet if self.peak_sheet else None,
            "mfu_measured_peak": per_rank_tflops / self.peak_measured if self.peak_measured else None,
            "expert_load": load["per_expert"], "max_load_ratio": load["max_ratio"],
            "dropped_frac": load["dropped_frac"],
        }
        if "mtp_loss" in v:  # the whole step's, as loss
            record["mtp_loss"] = float(v["mtp_loss"])
        record.update(self.evaluations.pop(step + 1, {}))
        if self.rt.device.type == "cuda":
            record["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.rt.device) / 2**30
        self.log.write(record)
        self.exporter.observe(record)
        self.printer.step(record)
        check_finite(step + 1, loss, grad_norm)  # after the record: the file shows the step that diverged
        if self.rt.rank == 0:
            self.registry.set_state("step", step + 1)
        return end

    def close(self) -> None:
        self.log.close()


def train(cfg: Config) -> int:
    rt = init_runtime(cfg)
    seed_everything(cfg.run.seed)
    registry = Registry(redis_url(), cfg.run.name)
    groups = init_groups(cfg, rt.world_size, rt.rank)
    source = checkpointing.checkpoint_source(registry, cfg, rt.rank)
    model = build_model(cfg, rt, groups, source=source)
    apply_model_memory_policy(model, cfg)
    optimizer = build_rank_optimizer(model, cfg, groups)
    for moe in model.moe_layers():
        moe.aux_loss_scale = 1.0 / cfg.data.grad_accum

    from services.dataloader.client import DataClient

    data = DataClient.from_registry(registry, dp_rank=groups.dp.rank, dp_size=groups.dp.size, cfg=cfg)
    saver = checkpointing.connect(registry, cfg, rt.rank, rt.world_size)
    shard_groups = groups if rt.world_size > 1 else None  # a folded layout saves and reads parameters' boxes
    try:
        start_step = checkpointing.restore(cfg, model, optimizer, data, rt.rank, shard_groups, source)
    finally:
        source.close()  # the resume is read (or refused): the checkpointer's channel is not needed again
    checkpointing.attach(saver, model, optimizer, rt.rank, shard_groups)  # host buffers now; copies fenced per step
    schedule = checkpointing.SaveSchedule(registry, cfg, saver, start_step)  # before registering: `Save` finds it
    exporter = TrainerMetrics().serve(cfg.run.bind_host, advertise=cfg.run.advertise_host)
    beat = registry.register("trainer", {"metrics": exporter.endpoint, "rank": rt.rank},
                             instance=f"rank{rt.rank}-{os.getpid()}")
    report = StepReporter(cfg, rt, groups, registry, exporter, start_step)

    # Step k is reported after step k+1 has been queued (StepValues): the host never drains the device's queue between
    # steps (while a save's copies run, up to MAX_UNREPORTED steps later). A step's time runs from the previous step's
    # end to its own, as the device saw them (StepEnd: the time between reports would be a step late whenever the host
    # is the bottleneck, and the last step's next to nothing).
    # A step ends after its checkpoint save: the save's copies, and any time the device idles while the host saves,
    # count in the step that saves.
    pending, last_end = deque(), StepEnd(rt.device)
    profiler = StepProfiler(cfg.run.profile_steps, Path(cfg.run.dir) / "profile", rt.rank, rt.device)
    try:
        for step in range(start_step, cfg.run.steps):
            profiler.begin(step + 1)
            t0 = time.perf_counter()
            micro_batches = data.next_step()
            data_wait = time.perf_counter() - t0
            lr = lr_at(step, cfg.optimizer, cfg.run.steps)
            values = train_step(model, optimizer, micro_batches, lr, cfg, rt, groups)
            # The previous steps: done on the device by now (this one still queued), unless a save's copies hold
            # their values back; then the host goes on queuing steps, up to MAX_UNREPORTED.
            behind = MAX_UNREPORTED if saver.copying else 0
            while pending and (len(pending) > behind or pending[0][1].ready()):
                last_end = report(*pending.popleft(), since=last_end)
            stall = 0.0
            if why := schedule.due(step + 1):
                # The host waits for this step here (at save steps only) to know it finite, then orders the save's
                # copies after it on the device and goes on
                while pending:
                    last_end = report(*pending.popleft(), since=last_end)
                try:
                    check_finite(step + 1, *loss_and_norm(values.read()))
                except TrainingDiverged:
                    report(step, values, StepEnd(rt.device), lr, data_wait, 0.0, since=last_end)  # its record; raises
                    raise
                stall = checkpointing.save(saver, cfg, model, optimizer, data, step + 1, shard_groups,
                                           skippable=why != "asked")
            pending.append((step, values, StepEnd(rt.device), lr, data_wait, stall))
            profiler.end(step + 1)
            if evaluation_due(cfg, step + 1):
                t0 = time.perf_counter()
                result = evaluate(model, data.eval_micro_batches(), groups, cfg, rt.device, rt.autocast_dtype)
                report.evaluated(step + 1, result, time.perf_counter() - t0)
                while pending:  # done on the device: the evaluation read its loss
                    last_end = report(*pending.popleft(), since=last_end)
                last_end = StepEnd(rt.device)  # the next step's time starts after the evaluation
        while pending:  # the last steps: nothing queued after them, the last end is the last work on the device
            last_end = report(*pending.popleft(), since=last_end)
        saver.wait()
    finally:
        profiler.close()
        beat.stop()
        exporter.close()
        saver.close()
        report.close()
    report.printer.done()
    return 0


@torch.no_grad()
def advance_router_bias(model: MoETransformer, cfg: Config) -> torch.Tensor:
    """Takes (and resets) the per-expert load of this step and applies the aux-loss-free bias update when enabled, on
    the device without waiting for it; resets the global aux loss's step statistics too (the one place a step ends for
    the routers, here and in the RL loop). Returns the loads, [MoE layers, experts] (empty without MoE layers)."""
    per_layer = []
    for moe in model.moe_layers():
        counts = moe.router.tokens_per_expert.clone()
        if cfg.model.bias_update_rate > 0:
            moe.router.update_bias(counts, cfg.model.bias_update_rate)
        moe.router.tokens_per_expert.zero_()
        moe.router.reset_step_statistics()
        per_layer.append(counts)
    return torch.stack(per_layer) if per_layer else torch.zeros(0, cfg.model.num_experts)


def expert_load_summary(loads: torch.Tensor, cfg: Config, data_parallel: int = 1) -> dict:
    """Mean load per expert, the worst layer's max/mean ratio and the dropped fraction of routed slots. Under data
    parallelism the loads were already summed over the stage (`sync_expert_load`): `data_parallel` replicas."""
    if not len(loads):
        return {"per_expert": [], "max_ratio": 1.0, "dropped_frac": 0.0}
    loads = loads.float()
    routed = cfg.data.micro_batch_size * cfg.data.seq_len * cfg.data.grad_accum * cfg.model.top_k * data_parallel
    kept = loads.sum(-1)
    return {
        "per_expert": loads.mean(0).tolist(),
        "max_ratio": float((loads.max(-1).values / loads.mean(-1).clamp_min(1e-9)).max()),
        "dropped_frac": float(1 - kept.mean() / routed) if routed else 0.0,
    }


# Why a rank stops, as one line (the messages name the cause and the fix) instead of a traceback, and its exit code:
# 2 for what must be fixed before starting again, 1 for a run that started and then lost its dataloader, a checkpoint
# save or Redis, or diverged. The launcher never restarts the trainer (services/launcher.py): any non-zero code ends
# the run.
USAGE_ERRORS = (ConfigError, RegistryError, checkpointing.CheckpointLoadError)
RUN_ERRORS = (DataError, SaveError, TimeoutError, RedisError, TrainingDiverged)


def run_rank(loop: Callable[[Config], int], argv: list[str] | None, prog: str, description: str) -> int:
    """A trainer entry point (pre-training and RL): `--config FILE [section.key=value ...]`, logging, then `loop`."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", default=None, help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args(argv)
    # As the services do: the INFO records of the modules the trainer uses (snapshot buffers, the FP8 backend) reach
    # the log. The per-step lines are printed, not logged, and torch's loggers do not propagate to this handler.
    logs.configure("trainer")
    try:
        code = loop(load_config(args.config, args.overrides))
        if torch.distributed.is_initialized():  # after a failure a peer may still be in a collective: exit instead
            torch.distributed.destroy_process_group()
        return code
    except (*USAGE_ERRORS, *RUN_ERRORS) as e:
        print(f"trainer: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, USAGE_ERRORS) else 1


def main(argv: list[str] | None = None) -> int:
    return run_rank(train, argv, "services.trainer.train", __doc__)


if __name__ == "__main__":
    sys.exit(main())
