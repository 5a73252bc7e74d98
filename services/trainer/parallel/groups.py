"""The one owner of process groups: Parallel Folding's two factorizations of the world, sharing the pipeline axis.

    attention / dense layers:  world = PP × DP × CP × TP      (TP innermost, then CP, then DP; PP outermost)
    MoE layers:                world = PP × EDP × EP × ETP    (ETP innermost, then EP, then EDP; PP outermost)

Both factorizations split the same PP stages, so a rank's stage and its index inside the stage are the same on both sides;
inside a stage the two sides are independent, which is what lets EP exceed DP (EP may span TP and CP ranks). Dense
gradients are reduced over DP×CP, expert gradients over EDP.

`rank_layout(layout)` is a pure function (no torch.distributed) giving every group's rank list; `init_groups` creates
them, calling `new_group` for every group on every rank in the same order as torch.distributed requires. Nothing else
in the project calls `new_group`. An axis of one rank has no group (None) and helpers skip its collective; at world
size 1 `single_process` gives the same object with every axis of size 1, so the code paths are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from services.common.config import Config, ConfigError, validate

ATTENTION_AXES = ("tp", "cp", "dp", "pp")  # innermost first
MOE_AXES = ("etp", "ep", "edp", "pp")


@dataclass(frozen=True)
class Layout:
    """The sizes of every axis for one world. `dp` and `edp` are derived from the others."""

    world: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp_sizes: tuple[int, ...] = ()  # dynamic CP sizes (aligned blocks of the CP axis); always holds `cp`

    @property
    def stage_size(self) -> int:
        return self.world // self.pp

    @property
    def dp(self) -> int:
        return self.world // (self.pp * self.tp * self.cp)

    @property
    def edp(self) -> int:
        return self.world // (self.pp * self.etp * self.ep)

    def sizes(self, axes: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in axes)

    def __str__(self) -> str:
        return (f"world={self.world}: attention pp{self.pp}×dp{self.dp}×cp{self.cp}×tp{self.tp}, "
                f"moe pp{self.pp}×edp{self.edp}×ep{self.ep}×etp{self.etp}")


def make_layout(cfg: Config, world_size: int) -> Layout:
    """The layout `cfg.parallel` asks for on `world_size` ranks; an impossible one raises ConfigError naming the sizes."""
    p = cfg.parallel
    validate(cfg, world_size)
    if world_size % p.pp:
        raise ConfigError(f"world size {world_size} is not divisible by `parallel.pp={p.pp}`")
    stage = world_size // p.pp
    if stage % (p.tp * p.cp):
        raise ConfigError(f"a pipeline stage of {stage} ranks (world {world_size} / pp {p.pp}) is not divisible by "
                          f"tp*cp = {p.tp}*{p.cp}; change parallel.tp/cp or the number of ranks")
    if stage % (p.etp * p.ep):
        raise ConfigError(f"a pipeline stage of {stage} ranks (world {world_size} / pp {p.pp}) is not divisible by "
                          f"etp*ep = {p.etp}*{p.ep}; change parallel.ep/etp or the number of ranks")
    for c in p.cp_sizes:
        if c < 1 or p.cp % c:
            raise ConfigError(f"`parallel.cp_sizes` entry {c} does not divide `parallel.cp={p.cp}` (dynamic CP groups "
                              f"are aligned blocks of the CP axis; use sizes dividing cp and set cp to the largest)")
    return Layout(world=world_size, tp=p.tp, cp=p.cp, pp=p.pp, ep=p.ep, etp=p.etp,
                  cp_sizes=tuple(sorted(set(p.cp_sizes) | {p.cp})))


def coordinates(layout: Layout, rank: int, axes: tuple[str, ...]) -> dict[str, int]:
    """This rank's index along each axis of one factorization (axes innermost first)."""
    out, rest = {}, rank
    for name, size in zip(axes, layout.sizes(axes)):
        out[name] = rest % size
        rest //= size
    return out


def _groups_varying(layout: Layout, axes: tuple[str, ...], varying: set[str], block: dict[str, int] | None = None
                    ) -> list[tuple[int, ...]]:
    """Partition the world into groups whose members differ only along `varying` (within blocks of `block[axis]`).

    Members are in ascending global rank, which is also the group rank: the innermost varying axis moves fastest.
    """
    block = block or {}
    buckets: dict[tuple, list[int]] = {}
    for r in range(layout.world):
        c = coordinates(layout, r, axes)
        key = tuple(c[a] // block[a] if a in block else (None if a in varying else c[a]) for a in axes)
        buckets.setdefault(key, []).append(r)
    return [tuple(members) for members in buckets.values()]


def rank_layout(layout: Layout) -> dict[str, list[tuple[int, ...]]]:
    """Every group of every axis as global rank lists; keys: tp, cp, dp, dp_cp, pp, etp, ep, edp, ep_etp (the ranks
    that together hold every expert once: where tokens are dispatched) and `cp<size>` per dynamic CP size (`cp<cp>`
    equals `cp`)."""
    a, m = ATTENTION_AXES, MOE_AXES
    out = {
        "tp": _groups_varying(layout, a, {"tp"}),
        "cp": _groups_varying(layout, a, {"cp"}),
        "dp": _groups_varying(layout, a, {"dp"}),
        "dp_cp": _groups_varying(layout, a, {"dp", "cp"}),
        "pp": _groups_varying(layout, a, {"pp"}),
        "etp": _groups_varying(layout, m, {"etp"}),
        "ep": _groups_varying(layout, m, {"ep"}),
        "edp": _groups_varying(layout, m, {"edp"}),
        "ep_etp": _groups_varying(layout, m, {"ep", "etp"}),
    }
    for c in layout.cp_sizes:
        out[f"cp{c}"] = _groups_varying(layout, a, {"cp"}, block={"cp": c})
    return out


def ep_spans_replicas(layout: Layout) -> bool:
    """Whether some EP×ETP group holds ranks of different attention DP replicas, whose micro-batches differ (in RL
    also in length: packed trajectories)."""
    dp_of = [coordinates(layout, r, ATTENTION_AXES)["dp"] for r in range(layout.world)]
    return any(len({dp_of[r] for r in members}) > 1 for members in rank_layout(layout)["ep_etp"])


@dataclass(frozen=True)
class Axis:
    """One process group as seen by this rank. `group` is None exactly when the axis has one rank: no group is created
    for it and callers skip the collective (`None` means the WORLD to torch.distributed, so never pass it through)."""

    name: str
    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]  # global ranks, in group-rank order
    rank: int  # this rank's index in `ranks`

    @property
    def size(self) -> int:
        return len(self.ranks)


def sum_over(t, *axes: Axis):
    """`t` summed over `axes` in place (all-reduce, skipped for one-rank axes), queued: nothing here waits for the
    device. Returns `t`."""
    for axis in axes:
        if axis.size > 1:
            dist.all_reduce(t, group=axis.group)
    return t


@dataclass(frozen=True)
class ParallelGroups:
    layout: Layout
    global_rank: int
    tp: Axis
    cp: Axis
    dp: Axis
    dp_cp: Axis  # dense gradients are reduced here
    pp: Axis
    etp: Axis
    ep: Axis
    edp: Axis  # expert gradients are reduced here
    ep_etp: Axis  # tokens are dispatched over these ranks: together they hold every expert once
    world: Axis
    cp_by_size: dict[int, Axis] = field(default_factory=dict)  # dynamic CP: size -> this rank's aligned block

    def cp_of(self, size: int) -> Axis:
        if size not in self.cp_by_size:
            raise ValueError(f"no CP group of size {size}; pre-built sizes are {sorted(self.cp_by_size)} "
                             f"(add it to parallel.cp_sizes)")
        return self.cp_by_size[size]

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    @property
    def data_rank(self) -> int:
        """Which data-parallel replica this rank belongs to: the dataloader's dp_rank (TP and CP peers share it)."""
        return self.dp.rank

    @property
    def data_size(self) -> int:
        return self.dp.size


def _axis_for(name: str, groups: list[tuple[int, ...]], rank: int, make) -> Axis:
    mine = None
    for members in groups:
        g = make(members)  # every rank creates every group, in the same order
        if rank in members:
            mine = Axis(name, g, members, members.index(rank))
    assert mine is not None, f"rank {rank} is in no {name} group"
    return mine


def init_groups(cfg: Config, world_size: int | None = None, rank: int | None = None) -> ParallelGroups:
    """Create every process group of `cfg.parallel` (torch.distributed must be initialised when world size > 1)."""
    live = dist.is_available() and dist.is_initialized()
    world_size = world_size if world_size is not None else (dist.get_world_size() if live else 1)
    rank = rank if rank is not None else (dist.get_rank() if live else 0)
    layout = make_layout(cfg, world_size)
    if world_size == 1 and not live:
        return single_process(cfg)
    if not live:
        raise RuntimeError(f"world size {world_size} needs torch.distributed initialised first "
                           f"(torchrun sets it up; call dist.init_process_group before init_groups)")
    lists = rank_layout(layout)

    made: dict[tuple[int, ...], dist.ProcessGroup] = {}  # axes with the same ranks (dp_cp = dp when cp = 1) share one

    def make(members: tuple[int, ...]) -> dist.ProcessGroup | None:
        if len(members) > 1 and members not in made:
            made[members] = dist.new_group(list(members))  # the project's one new_group call
        return made.get(members)

    axes = {name: _axis_for(name, lists[name], rank, make) for name in
            ("tp", "cp", "dp", "dp_cp", "pp", "etp", "ep", "edp", "ep_etp")}
    cp_by_size = {layout.cp: axes["cp"]}
    for c in layout.cp_sizes:
        if c != layout.cp:
            cp_by_size[c] = _axis_for(f"cp{c}", lists[f"cp{c}"], rank, make)
    world = Axis("world", dist.group.WORLD, tuple(range(world_size)), rank)
    return ParallelGroups(layout=layout, global_rank=rank, world=world, cp_by_size=cp_by_size, **axes)


def single_process(cfg: Config | None = None) -> ParallelGroups:
    """The trivial layout: every axis one rank, every group None (no collective is ever issued)."""
    if cfg is not None:
        p = cfg.parallel
        if p.tp * p.cp * p.pp * p.ep * p.etp != 1:
            raise ConfigError(f"one process cannot run tp={p.tp} cp={p.cp} pp={p.pp} ep={p.ep} etp={p.etp}; "
                              f"start {max(p.tp * p.cp, p.ep * p.etp) * p.pp}+ ranks with torchrun")
    one = lambda name: Axis(name, None, (0,), 0)  # noqa: E731
    names = ("tp", "cp", "dp", "dp_cp", "pp", "etp", "ep", "edp", "ep_etp", "world")
    axes = {n: one(n) for n in names}
    return ParallelGroups(layout=Layout(world=1, cp_sizes=(1,)), global_rank=0, cp_by_size={1: axes["cp"]}, **axes)
