"""Dynamic context-parallel sizing: how many CP ranks each micro-batch needs, and which dp rank gets which.

Cost model: a micro-batch of segments l_1..l_n holds Σ l tokens and costs attention ∝ Σ l² (causal attention within each
document; padding runs are segments too, and cost like documents: the kernel does not know they are padding). Split over
c CP ranks (zigzag sharding keeps causal work even), each rank holds Σl / c tokens and does Σl² / c attention work.
The smallest allowed c that keeps both under budget is chosen: a larger CP group costs communication for nothing.

Dealing: once sized, a step's micro-batches go to the dp ranks by `deal_by_cost` over their `work` (longest processing
time first), both streams alike: the corpus (stream.py, equal counts per rank) and RL (rollout_source.py, any count).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from services.dataloader.errors import DataError


@dataclass(frozen=True)
class CPBudget:
    max_tokens_per_rank: int = 0  # 0: no limit
    max_attn_per_rank: float = 0.0  # Σ l² per rank; 0: no limit


def allowed_cp_sizes(parallel_cfg) -> list[int]:
    """The CP sizes micro-batches may be given: `parallel.cp_sizes`, or just `parallel.cp` when it is empty.

    A dp rank's micro-batches go to all of its `parallel.cp` CP peers, so a size must divide `parallel.cp` for the
    micro-batch to run on an aligned block of them (the pre-built CP groups).
    """
    cp, sizes = parallel_cfg.cp, sorted(set(parallel_cfg.cp_sizes or [parallel_cfg.cp]))
    bad = [c for c in sizes if c < 1 or cp % c]
    if bad:
        raise DataError(f"`parallel.cp_sizes={list(parallel_cfg.cp_sizes)}` has sizes {bad} that do not divide "
                        f"`parallel.cp={cp}`; every dynamic CP size must divide the CP dimension (e.g. 1, 2, 4 for cp=4)")
    return sizes


def segment_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    return (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()


def attention_cost(lengths: list[int]) -> int:
    return sum(n * n for n in lengths)


def choose_cp_size(lengths: list[int], cp_sizes: list[int], budget: CPBudget) -> int:
    """Smallest size in `cp_sizes` under budget; the largest one when none is (the micro-batch must still run)."""
    tokens, attn = sum(lengths), attention_cost(lengths)
    sizes = sorted(cp_sizes)
    for c in sizes:
        if ((not budget.max_tokens_per_rank or tokens <= budget.max_tokens_per_rank * c)
                and (not budget.max_attn_per_rank or attn <= budget.max_attn_per_rank * c)):
            return c
    return sizes[-1]


def work(lengths: list[int], scale: int) -> float:
    """Work of a micro-batch of segments `lengths` for its dp rank, in token-equivalents: the linear part (tokens) plus
    attention scaled so that a segment of `scale` tokens (the stream's packing unit: `data.seq_len`,
    `rl.micro_batch_tokens`) weighs as much again. Whatever its CP size: a micro-batch sized c runs on one block of c of
    the dp rank's `parallel.cp` ranks while the other blocks run others (context_parallel.py `cp_share`), so the dp
    rank's time is its micro-batches' summed work over `parallel.cp`; dividing by c would weigh small-c micro-batches
    cp / c times too much (bench/bench_cp_deal.py)."""
    return sum(lengths) + attention_cost(lengths) / scale


def block_share(sizes: list[int], costs: list[float], cp: int, cp_rank: int) -> list[tuple[int, int]]:
    """Which of its dp rank's micro-batches (CP sizes `sizes`, attention costs `costs`) CP rank `cp_rank` of `cp` runs,
    as (index, the CP size it runs at), in the order it runs them (the trainer's `context_parallel.cp_share`).

    A micro-batch sized c < cp runs on one aligned block of c ranks, not on all cp / c blocks (that would compute it
    cp / c times): each block takes an equal share of the size-c micro-batches, dealt costliest first in snake order.
    Every rank must run as many passes as its EP and PP peers in other blocks, whose collectives pair up pass by pass,
    so the n mod (cp / c) costliest micro-batches left over after equal shares run on the whole CP group instead (at
    size cp). Order: whole-group micro-batches first, as received, then the block's share size by size, largest
    first: at every pass the ranks of a CP group run the same micro-batch."""
    whole = [(i, c) for i, c in enumerate(sizes) if c >= cp]
    shares = []
    for c in sorted({c for c in sizes if c < cp}, reverse=True):
        blocks = cp // c
        costliest = sorted((i for i, size in enumerate(sizes) if size == c), key=lambda i: -costs[i])  # stable
        left_over = len(costliest) % blocks
        whole += [(i, cp) for i in costliest[:left_over]]
        shares += [(i, c) for i in sorted(i for k, i in enumerate(costliest[left_over:])
                                          if _snake(k, blocks) == cp_rank // c)]
    return sorted(whole) + shares


def _snake(k: int, blocks: int) -> int:
    """The block the k-th costliest item goes to: 0, 1, .., b-1, b-1, .., 0, 0, 1, ..."""
    lap, pos = divmod(k, blocks)
    return pos if lap % 2 == 0 else blocks - 1 - pos


def dp_rank_time(micro_batches: list[tuple[list[int], int]], cp: int, scale: int) -> float:
    """A dp rank's time running `micro_batches` ((segment lengths, CP size) each) on its `cp` CP ranks, in `work`
    units: the slowest CP rank's sum of work / (the size it runs at) over its `block_share`."""
    sizes = [c for _, c in micro_batches]
    costs = [attention_cost(lengths) for lengths, _ in micro_batches]
    return max(sum(work(micro_batches[i][0], scale) / c for i, c in block_share(sizes, costs, cp, r))
               for r in range(cp))


def deal_by_cost(costs: list[float], groups: int, per_group: int | None = None) -> list[list[int]]:
    """Deal items to `groups` groups evening out the summed cost: longest processing time first (Graham's LPT), each
    item, costliest first, to the least-loaded group (ties: the one with fewer items, then the lower index, so the plan
    is deterministic and every group gets an item while some group has none). Items keep ascending order in a group.

    `per_group`: exactly that many items per group (len(costs) must be groups*per_group), each to the least-loaded group
    that still has room; None: no limit, and then the largest load is at most the mean plus (1 - 1/groups) times the
    cost of the heaviest group's last item, which is at most the (groups+1)-th largest cost unless that group holds a
    single item (LPT's bound; then the largest load is one item's, which no plan beats).
    """
    if per_group is not None and len(costs) != groups * per_group:
        raise ValueError(f"{len(costs)} items cannot fill {groups} groups of {per_group}")
    heap = [(0.0, 0, g) for g in range(groups)]
    members: list[list[int]] = [[] for _ in range(groups)]
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        full = []
        load, count, g = heapq.heappop(heap)
        while count == per_group:
            full.append((load, count, g))
            load, count, g = heapq.heappop(heap)
        members[g].append(i)
        heapq.heappush(heap, (load + costs[i], count + 1, g))
        for item in full:
            heapq.heappush(heap, item)
    return [sorted(m) for m in members]
