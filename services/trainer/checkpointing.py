"""What the trainer puts into a checkpoint and takes back out of one.

Names are global and layout-free (`model/<param>`, `optim/<param>/exp_avg`, ...): a checkpoint stores each tensor's global
shape and every saved piece's offsets, so a run with another parallel layout reads exactly the slice it owns.

Per save the trainer is held only while the device-to-host copies are *enqueued* (services/checkpointer/snapshot.py):
- `attach` (once, after the model and optimizer exist) allocates the pinned host buffers in the background and installs
  `Snapshotter.fence` as an optimizer step pre-hook, so the next optimizer step never overwrites a tensor whose copy
  is still in flight;
- with `checkpoint.on_busy=skip` every rank skips the same saves (`should_skip` all-reduces the busy flag).

Which piece of which global tensor this rank saves is decided by `state_shards`, the one entry point: one rank (or plain
data parallel) saves every tensor whole, written by rank 0; a folded layout (`groups` given) takes each parameter's box
and the ZeRO-1 moments from services/trainer/parallel/checkpoint_shards.py, so each set of replicas is written once.

A bf16 parameter (`optimizer.param_dtype=bf16`) is saved as itself, `model/<param>`, with the low 16 bits of its fp32
master weight beside it, `optim/<param>/remainder` (kernels/adamw.py `split_master`); every reader here joins the two
(`saved_value`), so a restore gets the master weights back bit for bit, whatever dtype the restoring run holds.

A resume reads from `checkpoint_source`'s pick: `checkpoint.dir` itself where this host sees the checkpointer's
directory, else the checkpointer's gRPC service (services/checkpointer/remote.py); both offer the same reads.

`init_from` starts a run from another run's model weights (`checkpoint.init_from`, e.g. RL from a pre-trained model):
whole tensors, read before a parallel layout slices the model, with nothing else of that run.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from kernels.adamw import join_master
from services.checkpointer.fit import diff_hint, state_mismatch
from services.checkpointer.handoff import SERVICE, pick_writer
from services.checkpointer.layout import read_store_id
from services.checkpointer.load import CheckpointError, DirectorySource, load_checkpoint, resolve_checkpoint
from services.checkpointer.remote import ServiceSource
from services.checkpointer.save_requests import SaveRequests
from services.checkpointer.shard import Shard
from services.checkpointer.snapshot import Snapshotter, specs_of
from services.checkpointer.writer import host_name
from services.common import logs, net
from services.common.config import Config
from services.common.host_memory import TensorSpec
from services.common.registry import Registry

log = logs.logger("trainer")

CheckpointSource = DirectorySource | ServiceSource  # where a resume reads: the directory itself or the checkpointer


class CheckpointLoadError(RuntimeError):
    """The checkpoint to resume from exists but does not fit this run."""


def connect(registry: Registry, cfg: Config, rank: int, world_size: int) -> Snapshotter:
    # One session per trainer incarnation, identical on all its ranks: torchrun's run id and restart count.
    session = f"{os.environ.get('TORCHELASTIC_RUN_ID', os.getpid())}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
    return Snapshotter(registry=registry, rank=rank, world_size=world_size, on_busy=cfg.checkpoint.on_busy,
                       session=session, host_buffers=cfg.checkpoint.host_buffers,
                       stage_on_device=cfg.checkpoint.stage_on_device)


class SaveSchedule:
    """Which steps save: every `checkpoint.interval`-th, the run's last, and any asked for through the checkpointer's
    gRPC `Save`. Each rank asks `due` at every step boundary (it records the rank's progress, one Redis call); the
    answers are the same on every rank (services/checkpointer/save_requests.py says why)."""

    def __init__(self, registry: Registry, cfg: Config, saver: Snapshotter, start_step: int):
        self.every, self.last = cfg.checkpoint.interval, cfg.run.steps
        self.requests = SaveRequests(registry, saver.session, saver.rank, start_step, cfg.run.steps)

    def due(self, step: int) -> Literal["scheduled", "asked"] | None:
        """Whether `step` saves, and why: an asked-for save is never skipped (`save(skippable=False)`)."""
        asked = self.requests.decide(step)
        if step == self.last or (self.every > 0 and step % self.every == 0):
            return "scheduled"
        return "asked" if asked else None


REMAINDER = "optim/{}/remainder"


def saved_value(read, name: str, saved: set[str]) -> torch.Tensor:
    """Parameter `name`'s value in a checkpoint: `read("model/<name>")`, joined with its saved remainder into the fp32
    master weight when the run that saved it held the parameter in bf16. `read` takes a checkpoint name and returns
    the piece this reader wants (whole, or a box)."""
    value = read(f"model/{name}")
    if REMAINDER.format(name) in saved:
        return join_master(value, read(REMAINDER.format(name)))
    return value


# ---------------------------------------------------------------- what a rank saves


def _param_shard(name: str, t: torch.Tensor, rank: int) -> Shard:
    """One rank, or plain data parallel: every rank holds every tensor whole, rank 0 writes it."""
    return Shard(t.detach(), replicated=True, writer=rank == 0)


def _like_param(box: Shard, value: torch.Tensor) -> Shard:
    """Optimizer state shaped like its parameter lives in the parameter's box; a scalar (Adam's `step`) is one global
    value written by the rank that writes the parameter's first box."""
    if value.ndim == 0 or value.numel() == 1 and value.shape != box.tensor.shape:
        first = all(o == 0 for o in box.offsets)
        return Shard(value.reshape(1), replicated=True, writer=box.written and first)
    return Shard(value.detach().view(box.tensor.shape), box.global_shape, box.offsets, replicated=True,
                 writer=box.writer)


def _predicted_adam_state(p: torch.Tensor, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """What torch's Adam/AdamW will create for `p` at its first step, as meta tensors (shapes and dtypes only), so
    the host buffers can be allocated before the first step. Other optimizers: nothing (the first save allocates)."""
    if "betas" not in optimizer.defaults:
        return {}
    like = torch.empty(p.shape, dtype=p.dtype, device="meta")
    state = {"step": torch.empty((), dtype=torch.float32, device="meta"), "exp_avg": like, "exp_avg_sq": like}
    if optimizer.defaults.get("amsgrad"):
        state["max_exp_avg_sq"] = like
    return state


def state_shards(model: nn.Module, optimizer: Any, rank: int, groups: Any = None,
                 predict: bool = False) -> dict[str, Shard]:
    """Every tensor this rank contributes to a checkpoint, by global name, with its box in the global tensor.

    `groups`: the run's ParallelGroups for a folded layout (services/trainer/parallel/checkpoint_shards.py names each
    parameter's box, cut to the flat range this rank owns under ZeRO-1); None for one rank or plain data parallel.
    `predict`: fill optimizer state that does not exist yet (before the first step) with meta tensors of the shapes
    it will have (see `attach`).
    """
    if groups is not None:
        from services.trainer.parallel import checkpoint_shards as parallel
        from services.trainer.parallel.distributed_optimizer import DistributedOptimizer

        if isinstance(optimizer, DistributedOptimizer):
            optimizer.wait_params()  # the last step's all-gathers write the parameters being snapshotted
            shards = parallel.training_shards(model, optimizer, groups)
            optimizer = None
        else:
            shards = parallel.model_shards(model, groups)
    else:
        shards = {f"model/{n}": _param_shard(n, t, rank) for n, t in model.state_dict(keep_vars=True).items()}
    if isinstance(optimizer, torch.optim.Optimizer):
        names = {id(p): n for n, p in model.named_parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p) or (_predicted_adam_state(p, optimizer) if predict else {})
                box = shards[f"model/{names[id(p)]}"]
                for key, value in state.items():
                    # `master` (optim.MasterWeightAdamW) is an fp32 parameter itself, saved as `model/<param>` already
                    if key != "master" and isinstance(value, torch.Tensor):
                        shards[f"optim/{names[id(p)]}/{key}"] = _like_param(box, value)
    elif optimizer is not None:
        raise TypeError(f"cannot checkpoint an optimizer of type {type(optimizer).__name__}: neither a "
                        "torch.optim.Optimizer nor the parallel DistributedOptimizer")
    # RNG streams differ per rank, so each rank saves its own under its rank's name.
    shards[f"rng/rank{rank}/torch_cpu"] = Shard(torch.get_rng_state())
    if torch.cuda.is_available():
        shards[f"rng/rank{rank}/torch_cuda"] = Shard(torch.cuda.get_rng_state())
    return shards


def expected_specs(model: nn.Module, optimizer: Any, rank: int, groups: Any = None) -> dict[str, TensorSpec]:
    """The host buffers the saves of this run need, known before the first optimizer step."""
    return specs_of(state_shards(model, optimizer, rank, groups, predict=True))


# ---------------------------------------------------------------- saving


def attach(saver: Snapshotter, model: nn.Module, optimizer: Any, rank: int, groups: Any = None) -> None:
    """Call once the model and optimizer exist (and state was restored): starts allocating the pinned host buffers in
    the background and orders every snapshot's copies before the optimizer step that would overwrite the tensors."""
    if getattr(saver, "_attached_to", None) is optimizer:
        return
    saver._attached_to = optimizer
    register = getattr(optimizer, "register_step_pre_hook", None)
    if register is not None:
        register(lambda *_: saver.fence())
    else:
        # Without a hook the copies must be complete when `save` returns: correct, but the stall is the copy time.
        saver.sync_copy = True
        log.warning("%s has no register_step_pre_hook: checkpoint copies are synchronous; call saver.fence() right "
                    "before its step and set saver.sync_copy=False to overlap them", type(optimizer).__name__)
    saver.prepare(expected_specs(model, optimizer, rank, groups))


def should_skip(saver: Snapshotter) -> bool:
    """With on_busy="skip": True on every rank when any rank's buffers are all busy (a save that only some ranks
    make can never commit). One all-reduce per save step, issued by every rank since they share the config."""
    if saver.on_busy != "skip":
        return False
    busy = saver.busy
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([1 if busy else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        busy = bool(flag.item())
    return busy


def save(saver: Snapshotter, cfg: Config, model: nn.Module, optimizer: Any, data, step: int,
         groups: Any = None, skippable: bool = True) -> float:
    """Hands the state to the checkpointer; returns the stall (seconds the trainer was held: enqueuing the copies).
    `skippable=False` (a save asked for) waits for busy buffers even with checkpoint.on_busy=skip."""
    t0 = time.perf_counter()
    attach(saver, model, optimizer, saver.rank, groups)  # no-op once the trainer attached at start-up
    if skippable and should_skip(saver):
        if saver.rank == 0:
            print(f"trainer: checkpoint of step {step} skipped: the previous save is still being written "
                  "(checkpoint.on_busy=skip)", file=sys.stderr)
        return time.perf_counter() - t0
    extra = {"step": step, "data": data.state(), "config": cfg.to_dict()}
    with torch.profiler.record_function("checkpoint save"):  # a range in run.profile_steps' trace
        saver.save(step, state_shards(model, optimizer, saver.rank, groups), extra, skip_if_busy=False)
    return time.perf_counter() - t0


# ---------------------------------------------------------------- restoring


def _read_whole(ckpt, name: str, like: torch.Tensor) -> torch.Tensor:
    return _as_whole(name, ckpt.read(name), like)


def _as_whole(name: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`name`'s saved value `t` shaped like `like`: w13 saved by an ETP layout as [E, h, 2, f] is the same bytes as
    [E, h, 2f]."""
    if t.numel() != like.numel():
        raise CheckpointLoadError(f"{name!r} is saved as {list(t.shape)} but this run holds it as {list(like.shape)}")
    return t.reshape(like.shape)


def _mismatch(path, cause: Exception) -> CheckpointLoadError:
    return CheckpointLoadError(f"checkpoint {path} does not match this model ({cause}); "
                               "point checkpoint.dir elsewhere (or move its checkpoints away)")


def _read_all(ckpt, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) for each of `names`, in order, asked for in one `read_boxes`: through the checkpointer
    the requests keep a window in flight across tensors instead of one round trip each."""
    with closing(ckpt.read_boxes([(n, None, None) for n in names])) as tensors:
        yield from zip(names, tensors, strict=True)


def _restore_whole(ckpt, path, saved: set[str], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One rank (or plain data parallel): the whole model, then the optimizer state tensor by tensor as it arrives
    (held on the host at once: the model's values, as `load_state_dict` takes them, not the moments)."""
    state = model.state_dict()
    names = [f"model/{k}" for k in state] + [REMAINDER.format(k) for k in state if REMAINDER.format(k) in saved]
    try:
        values = dict(_read_all(ckpt, names))
        model_state = {k: saved_value(lambda n, t=t: _as_whole(n, values.pop(n), t), k, saved)
                       for k, t in state.items()}
        model.load_state_dict(model_state)
    except (KeyError, RuntimeError, ValueError, CheckpointError) as e:
        raise _mismatch(path, e) from None
    params = dict(model.named_parameters())
    for name, p in params.items():
        if "remainder" in optimizer.state[p]:  # a bf16 parameter: it and its remainder from the (fp32) master value
            optimizer.set_master(p, model_state[name])
    moments = [f"optim/{name}/{key}" for name in params for key in ("exp_avg", "exp_avg_sq", "step")
               if f"optim/{name}/{key}" in saved]
    for full, t in _read_all(ckpt, moments):
        name, key = full[len("optim/"):].rsplit("/", 1)
        p, state_p = params[name], optimizer.state[params[name]]
        t = t.reshape(()) if key == "step" else _as_whole(full, t, p)
        if key in state_p:  # created with the optimizer (MasterWeightAdamW): keep its device and dtype
            state_p[key].copy_(t)
            continue
        # fused AdamW keeps `step` on the parameter's device, the default one on the host
        on_device = key != "step" or optimizer.defaults.get("fused")
        state_p[key] = t.to(p.device if on_device else "cpu", torch.float32 if key == "step" else p.dtype)


def checkpoint_source(registry: Registry, cfg: Config, rank: int, timeout: float = 120.0) -> CheckpointSource:
    """Where this rank reads the checkpoint it resumes from: `checkpoint.dir` itself when it holds the directory a
    registered checkpointer writes (its `.store_id` is the one the checkpointer registered; that checkpointer verifies
    the checkpoint, once for all ranks), else that checkpointer's gRPC service, so that trainer hosts need not mount the
    checkpoint storage. Waits `timeout` seconds for a checkpointer to register (RegistryError after)."""
    records = registry.wait_for(SERVICE, 1, timeout=timeout)
    mine = read_store_id(cfg.checkpoint.dir)
    if sharing := [r for r in records if mine and r.get("store_id") == mine]:
        # the checkpointer still verifies: once for all ranks, not once per rank
        record = pick_writer(sharing, host_name(), rank)
        return DirectorySource(cfg.checkpoint.dir, verified_by=ServiceSource(record["grpc"], net.auth_token()))
    record = pick_writer(records, host_name(), rank)
    return ServiceSource(record["grpc"], net.auth_token(), record.get("dir", ""), record.get("load", ""))


def restore(cfg: Config, model: nn.Module, optimizer: torch.optim.Optimizer, data, rank: int,
            groups: Any = None, source: CheckpointSource | None = None) -> int:
    """Loads the newest valid checkpoint (if resuming and one exists); returns the step to start from. Refuses
    (CheckpointLoadError) to start over beside earlier checkpoints: with `checkpoint.resume=false`, or when none of them
    verifies. `groups`: as for `state_shards` (a folded layout reads only its own boxes, whatever layout wrote them).
    `source`: `checkpoint_source`'s (default: `checkpoint.dir` read directly)."""
    c = cfg.checkpoint
    source = source or DirectorySource(c.dir)
    if not c.resume:
        try:
            saved_before = source.saved()
        except CheckpointError as e:
            raise CheckpointLoadError(str(e)) from None
        if saved_before:
            raise CheckpointLoadError(
                f"checkpoint.dir={source.where} holds checkpoints up to {saved_before[0]} and checkpoint.resume=false "
                "starts a new run at step 0 beside them (the writer keeps the newest checkpoint.keep_last by step, "
                "so it would delete the new run's saves): point checkpoint.dir at a new directory, move them away, "
                "or set checkpoint.resume=true to continue from the newest")
        return 0
    try:
        ckpt = source.newest()
    except CheckpointError as e:
        raise CheckpointLoadError(f"checkpoint.dir={source.where}: nothing to resume from, and nothing was loaded or "
                                  f"deleted: {e}. Move the directory away to start over (or point checkpoint.dir "
                                  "elsewhere); restore its files from a copy to resume") from None
    if ckpt is None:
        return 0
    path = ckpt.path
    if "data" not in ckpt.extra:
        raise CheckpointLoadError(f"checkpoint {path} holds model weights only (no optimizer state or data position: "
                                  "written by `services.checkpointer.convert`), so a run cannot resume from it; start "
                                  f"one from it with checkpoint.init_from={Path(c.dir)} and another checkpoint.dir")
    saved = set(ckpt.names())
    if groups is not None:  # a folded layout reads its own boxes, whatever layout wrote them
        from services.trainer.parallel import checkpoint_shards as parallel

        try:
            parallel.load_shards(ckpt, model, optimizer, groups)
        except (KeyError, ValueError, RuntimeError, CheckpointError) as e:
            raise _mismatch(path, e) from None
    else:
        _restore_whole(ckpt, path, saved, model, optimizer)
    if f"rng/rank{rank}/torch_cpu" in saved:
        torch.set_rng_state(ckpt.read(f"rng/rank{rank}/torch_cpu"))
    if f"rng/rank{rank}/torch_cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state(ckpt.read(f"rng/rank{rank}/torch_cuda"))
    data.resume(ckpt.extra["data"])
    step = int(ckpt.extra["step"])
    if rank == 0:
        print(f"trainer: resumed from {path} at step {step}", file=sys.stderr)
        if changed := schedule_changes(ckpt.extra.get("config"), cfg):
            print(f"trainer: the learning-rate schedule is not the checkpoint's run's ({', '.join(changed)}): from "
                  f"step {step} it follows this run's settings", file=sys.stderr)
    return step


SCHEDULE_KEYS = (("optimizer", "lr"), ("optimizer", "min_lr"), ("optimizer", "warmup_steps"), ("optimizer", "decay"),
                 ("optimizer", "decay_steps"), ("run", "steps"))


def schedule_changes(recorded: dict[str, Any] | None, cfg: Config) -> list[str]:
    """`section.key=<there> there, <here> here` for each setting of the learning-rate schedule (optim.lr_at: a function
    of the step and these) the run that wrote a checkpoint had otherwise; [] when it recorded none."""
    mine = cfg.to_dict()
    return [f"{s}.{k}={recorded[s][k]!r} there, {mine[s][k]!r} here" for s, k in SCHEDULE_KEYS
            if recorded and k in recorded.get(s, {}) and recorded[s][k] != mine[s][k]]


# ---------------------------------------------------------------- initialising from another run's weights


def resolve_init_from(spec: str) -> Path:
    """`checkpoint.init_from` -> the committed checkpoint to read: the directory itself when it is one (it must
    verify), else the newest checkpoint under it that verifies."""
    if not Path(spec).expanduser().exists():
        raise CheckpointLoadError(f"checkpoint.init_from={spec}: no such file or directory")
    try:
        return resolve_checkpoint(spec)
    except CheckpointError as e:
        raise CheckpointLoadError(f"checkpoint.init_from: {e}; name a checkpoint directory (step_NNNNNNNN with a "
                                  "manifest.json) or a checkpoint.dir that holds some") from None


def resumable(cfg: Config, source: CheckpointSource | None = None) -> Path | str | None:
    """The checkpoint `restore` will resume from, by its manifest only, or None when the run starts fresh. When it
    names one, `restore` either loads every parameter from a checkpoint or stops the run: were the newest one's files
    damaged, it falls back to an older one, or stops naming each one's problem."""
    if not cfg.checkpoint.resume:
        return None
    try:
        ckpt = (source or DirectorySource(cfg.checkpoint.dir)).newest(checksums=False)
    except CheckpointError:  # none verifies: `restore` stops the run
        return None
    if ckpt is None:
        return None
    with ckpt:
        return ckpt.path  # a remote one's names the checkpointer it is read through


def init_from(cfg: Config, model: nn.Module, rank: int = 0, resuming: Path | str | None = None, groups: Any = None,
              shapes: dict[str, tuple[int, ...]] | None = None) -> Path | None:
    """Loads the *model weights only* of `checkpoint.init_from` into `model`, when set and `resuming` is None; the
    optimizer, the step and the data position stay fresh. `resuming`: the checkpoint a resume will load over them
    (`resumable`'s answer, which the caller also needs, so it scans the manifests once), or None to load (nothing to
    resume, or the RL reference policy, which is the initial one). `model`, `groups` and `shapes` as `load_weights`
    takes them. Returns the checkpoint loaded, or None."""
    spec = cfg.checkpoint.init_from
    if not spec:
        return None
    if resuming is not None:
        if rank == 0:
            print(f"trainer: checkpoint.init_from={spec} ignored: resuming from {resuming}", file=sys.stderr)
        return None
    path = resolve_init_from(spec)
    step = load_weights(path, cfg, model, groups, shapes, "checkpoint.init_from: ")
    if rank == 0:
        print(f"trainer: initialised the model weights from {path} (step {step}); optimizer, step and data "
              "start fresh", file=sys.stderr)
    return path


def load_weights(path: Path, cfg: Config, model: nn.Module, groups: Any = None,
                 shapes: dict[str, tuple[int, ...]] | None = None, what: str = "") -> int:
    """The model weights of the verified checkpoint `path` into `model`: the whole model, or with `groups` this rank's
    slices of a folded layout, each read as its own box (whatever layout saved it), `shapes` the whole model's state
    (name -> shape). Another model than `cfg.model`'s is refused naming what differs (`what` prefixes the message).
    Returns the checkpoint's step."""
    from services.trainer.parallel.checkpoint_shards import read_local

    ckpt = load_checkpoint(path, checksums=False)
    shapes = shapes or {name: tuple(t.shape) for name, t in model.state_dict().items()}
    why = state_mismatch({n.removeprefix("model/"): ckpt.global_shape(n) for n in ckpt.names() if n.startswith("model/")},
                         shapes)
    if why is not None:
        hint = diff_hint((ckpt.extra.get("config") or {}).get("model"), cfg.to_dict()["model"])
        raise CheckpointLoadError(f"{what}{path} holds another model than this one: {why}{hint}")
    names = set(ckpt.names())
    try:
        with torch.no_grad():
            for name, p in model.named_parameters():
                read = (lambda n, p=p: _read_whole(ckpt, n, p)) if groups is None else \
                    (lambda n, p=p: read_local(ckpt, n, p, groups))
                p.copy_(saved_value(read, name, names))
            for name, b in model.named_buffers():
                if f"model/{name}" in names:
                    b.copy_(_read_whole(ckpt, f"model/{name}", b))
    except CheckpointError as e:
        raise CheckpointLoadError(f"{what}{e}") from None
    return ckpt.step
