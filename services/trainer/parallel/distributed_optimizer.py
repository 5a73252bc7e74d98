"""Data parallelism with the distributed optimizer (ZeRO-1): bucketed gradient reduce-scatter overlapped with backward.

Parameters fall in two domains reduced over different groups: dense parameters over DP×CP, routed-expert parameters over
EDP (their other copies live on the EDP ranks; see `groups.py`). Each domain's parameters are packed, in reverse
registration order (roughly the order backward produces their gradients), into flat buckets of `parallel.grad_bucket_mb`.
A parameter's data becomes a view into its bucket's flat parameter buffer, and its gradient is moved into the bucket's
flat fp32 gradient buffer by a post-accumulate-grad hook (then `.grad` is freed): copied by its first backward of the
step, added by later ones, so the buffer is never zeroed as a whole (a parameter that got no gradient is zeroed when
its bucket launches). When the last expected micro-batch has
delivered every gradient of a bucket, the bucket's reduce-scatter is launched asynchronously — while backward still runs
for the earlier layers. Buckets launch in index order on every rank, so collectives match across ranks.

Each rank of a reducing group of size n owns 1/n of every bucket: only for that range does it keep fp32 master weights
and Adam moments, and compute the update; an all-gather then refreshes the full bucket on every rank. With
`optimizer.param_dtype=bf16` the buckets' parameters are bf16 (so are the all-gathers and the gradients autograd
produces; the gradient buckets stay fp32) and the owned range's fp32 master weights are its bf16 values plus an int16
remainder each (kernels/adamw.py `split_master`), updated together by kernels/adamw.py; the parameters that stay fp32
(`optim.stays_fp32`: embedding, norms, router) have buckets of their own. The all-gathers
are launched asynchronously at the end of `step`, in the order the next forward pass needs the buckets, and each module
waits for its own parameters' buckets (and its direct children's) in a forward pre-hook, so the gathers overlap the
next forward. Anything else that reads parameters between steps calls `wait_params()` (the checkpoint snapshot does;
`model.state_dict()` does through a hook; the next `step` does). Gradients are
SUMMED over the group: with the loss divided by the loss tokens of the whole step (all ranks), a parallel step equals one
process over all micro-batches. With `parallel.distributed_optimizer=false` the same buckets are all-reduced and every
rank updates the whole bucket.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from kernels.adamw import adamw_step, split_master
from services.common.config import OptimizerConfig
from services.trainer.optim import DTYPES, stays_fp32
from services.trainer.parallel.expert_parallel import is_expert_param
from services.trainer.parallel.groups import Axis, ParallelGroups

# torch 2.13 renames the tensor-in/tensor-out collectives; 2.11 only has the old names (same signatures).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Slot:
    """Where one parameter lives in its bucket."""

    name: str
    param: nn.Parameter
    start: int
    numel: int
    decay: bool  # weight decay applies (matrices; not norm scales)
    counted: bool  # counts toward the global grad norm on this rank (False for a TP-replicated copy on tp_rank > 0)
    arrived: bool = False  # its gradient reached the bucket this step (the next backward adds to it)


@dataclass
class Bucket:
    index: int
    domain: str  # "dense" or "expert"
    axis: Axis  # the group its gradients are reduced over
    slots: list[Slot]
    size: int  # padded to a multiple of the group size
    params: torch.Tensor  # flat parameter storage (the parameters are views into it)
    grads: torch.Tensor  # flat fp32 gradient accumulator
    lo: int = 0  # this rank's owned range [lo, hi)
    hi: int = 0
    arrivals: int = 0  # hook calls seen this step
    work: object = None
    launched: bool = False
    grad_shard: torch.Tensor | None = None
    master: torch.Tensor | None = None  # fp32 bucket: the owned range of its parameters (their own master weights)
    remainder: torch.Tensor | None = None  # bf16 bucket: int16 remainders of the owned range (the master's low bits)
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    decay_runs: list[tuple[int, int, bool]] = field(default_factory=list)  # owned range in (start, end, decays) runs
    norm_runs: list[tuple[int, int]] = field(default_factory=list)  # owned (start, end) runs counted in the grad norm
    slot_of: dict[int, Slot] = field(default_factory=dict)

    @property
    def sharded(self) -> bool:
        """Whether ZeRO-1 splits the bucket's optimizer state over its group: this rank then owns [lo, hi) only."""
        return self.hi - self.lo < self.size


def _domain(name: str, p: nn.Parameter) -> str:
    return "expert" if is_expert_param(name, p) else "dense"


def _weak(method: Callable) -> Callable:
    """`method`, holding its object weakly: once the object is gone, calls do nothing."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        return None if bound is None else bound(*args)
    return call


class DistributedOptimizer:
    """AdamW over bucketed, DP-reduced gradients. Use per step:

        opt.zero_grad(); opt.begin_step(num_micro_batches)
        ... forward/backward of every micro-batch (hooks launch the reductions) ...
        grad_norm = opt.step(lr)
    """

    def __init__(self, model: nn.Module, groups: ParallelGroups, cfg: OptimizerConfig, bucket_mb: float = 25.0,
                 shard: bool = True):
        self.cfg, self.groups, self.shard = cfg, groups, shard
        self.param_dtype, self.moment_dtype = DTYPES[cfg.param_dtype], DTYPES[cfg.moment_dtype]
        self.step_count = 0
        self.expected_arrivals = 1
        self.launch_log: list[int] = []  # bucket indices in launch order this step (tests read it to prove overlap)
        self.buckets = self._build_buckets(model, max(1, int(bucket_mb * 2**20)))
        self._next_launch = 0
        self._step_pre_hooks: list[Callable] = []
        # The model's hooks reach the optimizer through weak references only: a strong one would close a cycle
        # (optimizer -> bucket -> parameter -> hook -> optimizer) that keeps both alive until the cyclic GC runs.
        arrived = _weak(self._grad_arrived)
        for b in self.buckets:
            for k, s in enumerate(b.slots):
                s.param.register_post_accumulate_grad_hook(functools.partial(arrived, b.index, k))
        self._gathers: dict[int, object] = {}  # bucket index -> all-gather in flight since the last step
        self._gather_order = self._hook_gathers(model)

    def _hook_gathers(self, model: nn.Module) -> list[int]:
        """Forward pre-hooks that wait for the buckets each module reads; returns the buckets in first-needed order
        (modules in registration order, a parent before its children: the order forward reaches them)."""
        bucket_of = {id(s.param): b.index for b in self.buckets for s in b.slots}
        wait = _weak(self.wait_params)
        order: list[int] = []
        for module in model.modules():
            near = [*module.parameters(recurse=False), *(p for c in module.children() for p in c.parameters(False))]
            needs = sorted({bucket_of[id(p)] for p in near if id(p) in bucket_of})
            if needs:
                module.register_forward_pre_hook(lambda _m, _args, needs=needs: wait(needs))
                order.extend(i for i in needs if i not in order)
        model.register_state_dict_pre_hook(lambda *_: wait())
        return order + [b.index for b in self.buckets if b.index not in order]

    def wait_params(self, buckets: list[int] | None = None) -> None:
        """Wait for the parameter all-gathers of `buckets` (None: all) launched by the last `step`."""
        if not self._gathers:  # the common case in a forward pre-hook once the first modules have waited
            return
        for i in (list(self._gathers) if buckets is None else buckets):
            work = self._gathers.pop(i, None)
            if work is not None:
                work.wait()

    def register_step_pre_hook(self, hook: Callable) -> None:
        """`hook(optimizer, args, kwargs)` runs at the start of every `step`, as with torch optimizers (the
        checkpointer orders its snapshot copies before the step this way)."""
        self._step_pre_hooks.append(hook)

    # ------------------------------------------------------------ layout

    def _build_buckets(self, model: nn.Module, bucket_bytes: int) -> list[Bucket]:
        """Buckets per (domain, storage dtype): with bf16 parameters, those that stay fp32 (`optim.stays_fp32`) fill
        buckets of their own, closed with the domain's bf16 bucket, so that buckets still complete (and launch, in
        index order) in the order backward produces their gradients."""
        open_: dict[tuple[str, torch.dtype], list[tuple[str, nn.Parameter]]] = {}
        filled: dict[tuple[str, torch.dtype], int] = {}
        groups_of_params: list[tuple[str, torch.dtype, list[tuple[str, nn.Parameter]]]] = []
        for name, p in reversed(list(model.named_parameters())):
            if not p.requires_grad:
                continue
            key = (_domain(name, p), torch.float32 if stays_fp32(name, p) else self.param_dtype)
            if not open_.get(key):
                open_[key], filled[key] = [], 0
                groups_of_params.append((*key, open_[key]))
            open_[key].append((name, p))
            filled[key] += p.numel() * 4
            if filled[key] >= bucket_bytes:
                for other in open_:
                    if other[0] == key[0]:
                        open_[other] = []
        return [self._make_bucket(i, d, dtype, members) for i, (d, dtype, members) in enumerate(groups_of_params)]

    def _make_bucket(self, index: int, domain: str, dtype: torch.dtype,
                     members: list[tuple[str, nn.Parameter]]) -> Bucket:
        axis = self.groups.edp if domain == "expert" else self.groups.dp_cp
        tp = self.groups.tp
        n = axis.size
        total = sum(p.numel() for _, p in members)
        size = -(-total // n) * n
        ref = members[0][1]
        values = torch.zeros(size, dtype=torch.float32, device=ref.device)  # the parameters' values, fp32
        grads = torch.zeros(size, dtype=torch.float32, device=ref.device)
        for (_, p), start in zip(members, itertools.accumulate((p.numel() for _, p in members), initial=0)):
            values[start:start + p.numel()].copy_(p.detach().reshape(-1))
        params, remainder = (values, None) if dtype == values.dtype else split_master(values)
        slots, start = [], 0
        for name, p in members:
            p.data = params[start:start + p.numel()].view_as(p)
            # Count each element once in the world: TP-replicated parameters on tp rank 0 only; without sharding, every
            # replica of the reducing group holds the whole reduced gradient, so replica 0 only.
            counted = (domain == "expert" or hasattr(p, "tensor_parallel_dim") or tp.rank == 0) and \
                (self.shard or axis.rank == 0)
            slots.append(Slot(name, p, start, p.numel(), p.ndim >= 2, counted))
            start += p.numel()
        b = Bucket(index, domain, axis, slots, size, params, grads)
        b.lo, b.hi = ((axis.rank * size // n, (axis.rank + 1) * size // n) if self.shard else (0, size))
        if remainder is None:
            b.master = values[b.lo:b.hi]
        else:
            b.remainder = remainder[b.lo:b.hi].clone()
        b.exp_avg, b.exp_avg_sq = (torch.zeros(b.hi - b.lo, dtype=self.moment_dtype, device=ref.device)
                                   for _ in range(2))
        for s in slots:
            lo, hi = max(s.start, b.lo) - b.lo, min(s.start + s.numel, b.hi) - b.lo
            if lo >= hi:
                continue
            if b.decay_runs and b.decay_runs[-1][1] == lo and b.decay_runs[-1][2] == s.decay:
                b.decay_runs[-1] = (b.decay_runs[-1][0], hi, s.decay)
            else:
                b.decay_runs.append((lo, hi, s.decay))
            if s.counted and b.norm_runs and b.norm_runs[-1][1] == lo:
                b.norm_runs[-1] = (b.norm_runs[-1][0], hi)
            elif s.counted:
                b.norm_runs.append((lo, hi))
        return b

    # ------------------------------------------------------------ gradient path

    def zero_grad(self) -> None:
        """Start a step: every slot's first gradient overwrites the bucket (no pass zeroes the buffers)."""
        for b in self.buckets:
            b.arrivals, b.work, b.launched, b.grad_shard = 0, None, False, None
            for s in b.slots:
                s.param.grad = None
                s.arrived = False
        self._next_launch = 0
        self.launch_log = []

    def begin_step(self, num_micro_batches: int) -> None:
        """How many backward passes will deliver gradients this step: a bucket is reduced after the last one."""
        self.expected_arrivals = max(1, num_micro_batches)

    def _grad_arrived(self, bucket_index: int, slot_index: int, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook of the bucket's `slot_index`-th parameter: move its gradient into the bucket."""
        bucket = self.buckets[bucket_index]
        slot = bucket.slots[slot_index]
        into = bucket.grads[slot.start:slot.start + slot.numel]
        if slot.arrived:
            into.add_(p.grad.reshape(-1))
        else:
            into.copy_(p.grad.reshape(-1))
            slot.arrived = True
        p.grad = None  # the bucket holds the gradient from here on
        bucket.arrivals += 1
        if bucket.arrivals == len(bucket.slots) * self.expected_arrivals:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch complete buckets in index order (every rank issues the same collectives in the same order)."""
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if b.arrivals < len(b.slots) * self.expected_arrivals:
                return
            self._launch(b)

    def _launch(self, b: Bucket) -> None:
        for s in b.slots:  # no gradient this step (unused by the forward): zero, as if it had arrived as zeros
            if not s.arrived:
                b.grads[s.start:s.start + s.numel].zero_()
                s.arrived = True
        n = b.axis.size
        if n > 1 and self.shard:
            b.grad_shard = torch.empty(b.hi - b.lo, dtype=b.grads.dtype, device=b.grads.device)
            b.work = _reduce_scatter_single(b.grad_shard, b.grads, group=b.axis.group, async_op=True)
        elif n > 1:
            b.work = dist.all_reduce(b.grads, group=b.axis.group, async_op=True)
        b.launched = True
        self._next_launch += 1
        self.launch_log.append(b.index)

    def finish_grad_sync(self) -> None:
        """Launch what backward left (parameters without gradients count as zero) and wait for every reduction."""
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
            if b.grad_shard is None:
                b.grad_shard = b.grads[b.lo:b.hi]

    # ------------------------------------------------------------ the update

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm over all parameters, each element counted once across every group."""
        device = self.buckets[0].grads.device if self.buckets else torch.device("cpu")
        sq = torch.zeros((), dtype=torch.float32, device=device)
        for b in self.buckets:  # the counted runs only: no mask pass (the sums stay in the order they had with one)
            for lo, hi in b.norm_runs:
                sq += b.grad_shard[lo:hi].square().sum()
        if self.groups.world.size > 1:
            dist.all_reduce(sq, group=self.groups.world.group)
        return sq.sqrt()

    @torch.no_grad()
    def step(self, lr: float) -> torch.Tensor:
        """Finish the reductions, clip by the global norm, AdamW on the owned ranges, all-gather. Returns the norm."""
        for hook in self._step_pre_hooks:
            hook(self, (lr,), {})
        self.wait_params()  # a step without a forward since the last one (nothing waited yet)
        self.finish_grad_sync()
        norm = self.grad_norm()
        self.step_count += 1
        self._adamw(lr, norm)
        self._gather_params()
        return norm

    def _adamw(self, lr: float, norm: torch.Tensor) -> None:
        """AdamW on the owned ranges: kernels/adamw.py once per run of elements with one weight-decay setting. An fp32
        bucket's owned range is its own master; a bf16 bucket's master is its owned range joined with the remainders,
        both rewritten. Clipping by the global norm is the kernel's gradient divisor (it divides each
        gradient as it reads it), so it costs no pass of its own and leaves the gradient shards unclipped."""
        c = self.cfg
        # clip_grad_norm_'s factor clip / (norm + 1e-6) <= 1, as the divisor the kernel takes
        divisor = ((norm + 1e-6) / c.clip_grad).clamp(min=1.0) if c.clip_grad > 0 else None
        for b in self.buckets:
            master, owned = (b.master, None) if b.remainder is None else (b.remainder, b.params[b.lo:b.hi])
            for lo, hi, decays in b.decay_runs:
                adamw_step(master[lo:hi], b.grad_shard[lo:hi], b.exp_avg[lo:hi], b.exp_avg_sq[lo:hi],
                           None if owned is None else owned[lo:hi], lr=lr, beta1=c.beta1, beta2=c.beta2, eps=c.eps,
                           weight_decay=c.weight_decay if decays else 0.0, step=self.step_count, grad_divisor=divisor)

    def _gather_params(self) -> None:
        """Launch every bucket's all-gather, first-needed first; forward pre-hooks (or `wait_params`) wait for them."""
        for i in self._gather_order:
            b = self.buckets[i]
            if b.axis.size > 1 and self.shard:
                self._gathers[i] = _all_gather_single(b.params, b.params[b.lo:b.hi].clone(), group=b.axis.group,
                                                      async_op=True)

    # ------------------------------------------------------------ inspection (tests, checkpoints)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every local parameter's reduced gradient (after `finish_grad_sync`), gathered over its reducing group;
        unclipped, also after `step` (the AdamW kernel divides by the clip divisor as it reads, writes nothing back)."""
        out = {}
        for b in self.buckets:
            flat = b.grad_shard
            if self.shard and b.axis.size > 1:
                flat = torch.empty(b.size, dtype=b.grad_shard.dtype, device=b.grad_shard.device)
                _all_gather_single(flat, b.grad_shard.contiguous(), group=b.axis.group)
            for s in b.slots:
                out[s.name] = flat[s.start:s.start + s.numel].view_as(s.param).clone()
        return out
