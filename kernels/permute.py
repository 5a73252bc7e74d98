"""Permute: copy each token once per routed expert, grouped by expert, in token order within an expert.

    permute(hidden [T, h], indices [T, k], num_experts, probs=None) -> Permutation

`indices[t, j]` is the j-th expert of token t (what top-k returns; a token's experts are distinct), or negative for a
copy that was dropped (capacity overflow); an index >= num_experts is a caller bug that is not detected (checking
would need a host sync). The permuted buffer always has T*k rows: rows [offsets[e], offsets[e+1])
hold expert e's tokens, rows from `offsets[E]` on are zero rows, one per dropped copy. A fixed shape is what lets the
whole thing run without the host learning any count: the histogram, the exclusive scan and every destination row are
computed on the device, and the grouped GEMM reads its group boundaries from `offsets` in device memory.

Kernels (all int32 metadata, O(T*k) work) before the one data pass:
1. per (token block, expert block): how many copies of the block's tokens go to each expert (bucket E = dropped);
2. one program: per-expert totals, their exclusive scan (the expert offsets), and per token block the first row of
   each expert's run that the block owns (a column-wise scan over blocks);
3. per (token block, expert block) again: each copy's row = block base + copies of earlier tokens of the block in the
   same bucket + earlier slots of the same token in it (only dropped slots can share a bucket within a token);
4. the row scatter in `kernels/_rows.py`: one program per token, the token's row read once and written k times.

`permute(..., capacity=c)` (pad-to-capacity, `model.pad_to_capacity`) lays the rows out as E blocks of c rows instead:
expert e's kept copies at rows [e*c, e*c + count_e), in token order, the rest of its block zero rows (probs 0), and
dropped copies have no row (row_id_map -1). The same kernels place the copies (step 3's rows moved into the blocks by
one elementwise pass over the [T, k] map); every size is then known on the host (E*c rows, offsets e*c). The router's
capacity guarantees count_e <= c; it is not checked here (that would need a host sync).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels._rows import gather_rows, scatter_rows
from kernels._triton import next_power_of_2, use_triton


class Permutation(NamedTuple):
    permuted: torch.Tensor  # [T*k, h] rows grouped by expert; rows from offsets[E] on are zeros (dropped copies)
    row_id_map: torch.Tensor  # [T, k] int32: row of token t's j-th copy; ~row (negative) for a dropped copy
    tokens_per_expert: torch.Tensor  # [E] int32, on the device
    offsets: torch.Tensor  # [E+1] int32: expert e owns rows [offsets[e], offsets[e+1]); grouped_mm takes offsets[1:]
    permuted_probs: torch.Tensor | None  # [T*k] probs in permuted order (0 on dropped rows), when probs were given
    # With `capacity`: permuted [E*capacity, h], row_id_map -1 for a dropped copy, tokens_per_expert capacity each (the
    # expert's rows, padding included), offsets e*capacity, permuted_probs [E*capacity] (0 on padding).


def _check(hidden: torch.Tensor, indices: torch.Tensor, num_experts: int, probs: torch.Tensor | None,
           capacity: int | None = None) -> None:
    if capacity is not None and capacity < 1:
        raise ValueError(f"permute's capacity must be >= 1 rows per expert, got {capacity}")
    if hidden.dim() != 2 or indices.dim() != 2 or hidden.shape[0] != indices.shape[0]:
        raise ValueError(f"permute wants hidden [T, h] and indices [T, k] with the same T; got hidden "
                         f"{tuple(hidden.shape)} and indices {tuple(indices.shape)}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"permute wants integer expert indices (int32 or int64), got {indices.dtype}")
    if num_experts < 1:
        raise ValueError(f"permute needs num_experts >= 1, got {num_experts}")
    if probs is not None and probs.shape != indices.shape:
        raise ValueError(f"probs {tuple(probs.shape)} must have the shape of indices {tuple(indices.shape)}")
    if hidden.device != indices.device:
        raise ValueError(f"hidden is on {hidden.device} but indices on {indices.device}; move both to one device")


# ----------------------------------------------------------------------------------------------------------------------
# torch reference (also the CPU path)
# ----------------------------------------------------------------------------------------------------------------------

def permute_reference(hidden: torch.Tensor, indices: torch.Tensor, num_experts: int,
                      probs: torch.Tensor | None = None, capacity: int | None = None) -> Permutation:
    """Same contract as `permute`, in plain (differentiable) torch ops and without host synchronisation."""
    _check(hidden, indices, num_experts, probs, capacity)
    if capacity is not None:
        return _padded_reference(hidden, indices, num_experts, probs, capacity)
    T, k = indices.shape
    flat = indices.reshape(-1).long()
    bucket = torch.where(flat < 0, num_experts, flat)  # dropped copies sort after every expert
    order = torch.argsort(bucket, stable=True)  # stable: token order within an expert; order[row] = slot
    row_of_slot = torch.empty_like(order)
    row_of_slot[order] = torch.arange(T * k, device=flat.device)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))  # bincount would sync to size its output
    tokens_per_expert = counts[:num_experts].to(torch.int32)
    offsets = torch.cat([counts.new_zeros(1), counts[:num_experts].cumsum(0)]).to(torch.int32)
    routed_row = (bucket[order] < num_experts).unsqueeze(1)
    permuted = hidden.index_select(0, order // k) * routed_row.to(hidden.dtype)
    row_id_map = torch.where(flat >= 0, row_of_slot, -row_of_slot - 1).view(T, k).to(torch.int32)
    permuted_probs = None
    if probs is not None:
        permuted_probs = probs.reshape(-1)[order] * routed_row.squeeze(1).to(probs.dtype)
    return Permutation(permuted, row_id_map, tokens_per_expert, offsets, permuted_probs)


def _padded_reference(hidden, indices, num_experts: int, probs, capacity: int) -> Permutation:
    """`permute_reference` with `capacity`: the dropless layout's row map moved into capacity blocks, rows copied
    there (a spare row past the buffer takes the dropped copies' zero rows and is cut off)."""
    T, k = indices.shape
    plain = permute_reference(hidden, indices, num_experts)
    row_id_map = _into_capacity(plain.row_id_map, indices, plain.offsets, capacity)
    n = num_experts * capacity
    rows, routed = _slot_rows(row_id_map, spare=n)
    token = torch.arange(T * k, device=hidden.device) // k
    copies = hidden.index_select(0, token) * routed.unsqueeze(1).to(hidden.dtype)
    permuted = hidden.new_zeros(n + 1, hidden.shape[1]).index_copy(0, rows, copies)[:n]
    permuted_probs = None
    if probs is not None:
        values = probs.reshape(-1) * routed.to(probs.dtype)
        permuted_probs = probs.new_zeros(n + 1).index_copy(0, rows, values)[:n]
    return Permutation(permuted, row_id_map, *_capacity_sizes(num_experts, capacity, hidden.device), permuted_probs)


def _into_capacity(row_id_map: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
                   capacity: int) -> torch.Tensor:
    """A dropless row map (rows grouped by expert from `offsets`) moved into capacity blocks: a kept copy's row is
    expert * capacity + its place among the expert's copies; a dropped copy's is -1 (none). Elementwise on [T, k]."""
    routed = row_id_map >= 0
    expert = indices.clamp_min(0).long()
    place = row_id_map.long() - offsets.long()[expert]
    return torch.where(routed, expert * capacity + place, -1).to(torch.int32)


def _capacity_sizes(num_experts: int, capacity: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens_per_expert, offsets) of a capacity layout: every expert owns `capacity` rows."""
    tokens_per_expert = torch.full((num_experts,), capacity, dtype=torch.int32, device=device)
    offsets = torch.arange(num_experts + 1, dtype=torch.int32, device=device) * capacity
    return tokens_per_expert, offsets


# ----------------------------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------------------------

@triton.jit
def _slot_kernel(indices_ptr, block_counts_ptr, block_base_ptr, row_id_map_ptr, T, E,
                 K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                 WRITE_ROWS: tl.constexpr):
    # Bucket b in [0, E] (E = dropped) of every slot of BLOCK_T tokens, against BLOCK_E buckets of this program.
    # WRITE_ROWS=False: store the block's copy count per bucket.  True: store each slot's row given the block bases.
    pid_t = tl.program_id(0)
    tokens = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.arange(0, K_PAD)
    buckets = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    valid = (tokens < T)[:, None] & (slots < K)[None, :]
    expert = tl.load(indices_ptr + tokens[:, None].to(tl.int64) * K + slots[None, :], mask=valid, other=0)
    slot_bucket = tl.where(expert < 0, E, expert).to(tl.int32)
    slot_bucket = tl.where(valid, slot_bucket, -1)  # padding matches no bucket
    hit = slot_bucket[:, :, None] == buckets[None, None, :]  # [BLOCK_T, K_PAD, BLOCK_E]
    copies = tl.sum(hit.to(tl.int32), axis=1)  # [BLOCK_T, BLOCK_E] copies of token t in bucket b
    n_buckets = E + 1
    if not WRITE_ROWS:
        tl.store(block_counts_ptr + pid_t * n_buckets + buckets, tl.sum(copies, axis=0), mask=buckets < n_buckets)
    else:
        base = tl.load(block_base_ptr + pid_t * n_buckets + buckets, mask=buckets < n_buckets, other=0)
        first_row = base[None, :] + tl.cumsum(copies, axis=0) - copies  # [BLOCK_T, BLOCK_E]
        row = tl.sum(tl.where(hit, first_row[:, None, :], 0), axis=2)  # [BLOCK_T, K_PAD]
        in_program = tl.sum(hit.to(tl.int32), axis=2) > 0
        earlier = (slot_bucket[:, :, None] == slot_bucket[:, None, :]) & (slots[None, None, :] < slots[None, :, None])
        row += tl.sum(earlier.to(tl.int32), axis=2)
        value = tl.where(slot_bucket == E, -row - 1, row)
        tl.store(row_id_map_ptr + tokens[:, None].to(tl.int64) * K + slots[None, :], value, mask=valid & in_program)


@triton.jit
def _scan_kernel(block_counts_ptr, block_base_ptr, tokens_per_expert_ptr, offsets_ptr, n_blocks, E,
                 B_PAD: tl.constexpr, CHUNK: tl.constexpr):
    # One program: the per-bucket work is O(n_blocks * E) integers, a few hundred KB at most.
    buckets = tl.arange(0, B_PAD)
    n_buckets = E + 1
    bmask = buckets < n_buckets
    totals = tl.zeros([B_PAD], dtype=tl.int32)
    # `while` rather than `for ... in range(n_blocks)`: Triton 3.6's interpreter cannot take a runtime loop bound
    # under numpy >= 2.4, and n_blocks follows T, which must not be a compile-time constant.
    start = 0
    while start < n_blocks:
        blocks = start + tl.arange(0, CHUNK)
        m = (blocks < n_blocks)[:, None] & bmask[None, :]
        totals += tl.sum(tl.load(block_counts_ptr + blocks[:, None] * n_buckets + buckets[None, :], mask=m, other=0),
                         axis=0)
        start += CHUNK
    starts = tl.cumsum(totals, axis=0) - totals  # bucket E (dropped) starts after the last expert
    tl.store(tokens_per_expert_ptr + buckets, totals, mask=buckets < E)
    tl.store(offsets_ptr + buckets, starts, mask=bmask)
    carry = starts
    start = 0
    while start < n_blocks:
        blocks = start + tl.arange(0, CHUNK)
        m = (blocks < n_blocks)[:, None] & bmask[None, :]
        ptrs = blocks[:, None] * n_buckets + buckets[None, :]
        counts = tl.load(block_counts_ptr + ptrs, mask=m, other=0)
        tl.store(block_base_ptr + ptrs, carry[None, :] + tl.cumsum(counts, axis=0) - counts, mask=m)
        carry += tl.sum(counts, axis=0)
        start += CHUNK


def _row_id_map_triton(indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T, K = indices.shape
    device = indices.device
    indices = indices.contiguous()
    if T == 0:
        zeros = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)
        return torch.empty((0, K), dtype=torch.int32, device=device), zeros[:num_experts].clone(), zeros
    # Block sizes are fixed rather than autotuned (this metadata pass is O(T*k) int32 next to the O(T*k*h) data pass):
    # every bucket (up to 256) in one program, over 16-64 tokens. Measured on an H100 (bench/RESULTS.md): at T=8192,
    # k=8, E=128 both slot passes and the scan take 45 us of device time, against 120 us with the 64 tokens x 16
    # buckets per program used before; few experts keep 64 tokens, or the one-program scan over blocks grows.
    block_e = min(next_power_of_2(num_experts + 1), 256)
    block_t = max(16, min(64, 2048 // block_e))
    n_blocks = triton.cdiv(T, block_t)
    n_buckets = num_experts + 1
    block_counts = torch.empty((n_blocks, n_buckets), dtype=torch.int32, device=device)
    block_base = torch.empty_like(block_counts)
    tokens_per_expert = torch.empty(num_experts, dtype=torch.int32, device=device)
    offsets = torch.empty(n_buckets, dtype=torch.int32, device=device)
    row_id_map = torch.empty((T, K), dtype=torch.int32, device=device)
    grid = (n_blocks, triton.cdiv(n_buckets, block_e))
    meta = dict(K=K, K_PAD=next_power_of_2(K), BLOCK_T=block_t, BLOCK_E=block_e)
    _slot_kernel[grid](indices, block_counts, block_base, row_id_map, T, num_experts, WRITE_ROWS=False, **meta)
    b_pad = next_power_of_2(n_buckets)
    _scan_kernel[(1,)](block_counts, block_base, tokens_per_expert, offsets, n_blocks, num_experts,
                       B_PAD=b_pad, CHUNK=max(1, min(64, 8192 // b_pad)))
    _slot_kernel[grid](indices, block_counts, block_base, row_id_map, T, num_experts, WRITE_ROWS=True, **meta)
    return row_id_map, tokens_per_expert, offsets


def _slot_rows(row_id_map: torch.Tensor, spare: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per slot (flattened [T*k]): the row it owns and whether it is routed. A dropped slot owns its tail row, or in a
    capacity layout none: there it gets `spare`, one past the buffer (the caller's row to throw away)."""
    flat = row_id_map.reshape(-1).long()
    routed = flat >= 0
    dropped = -flat - 1 if spare is None else torch.full_like(flat, spare)
    return torch.where(routed, flat, dropped), routed


class _PermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, row_id_map, probs, rows):
        """`rows`: None, or a capacity layout's row count (zeros where no copy goes)."""
        permuted, _ = scatter_rows(hidden.contiguous(), row_id_map, rows=rows)
        permuted_probs = None
        if probs is not None:
            # T*k scalars: one torch scatter is as good as a kernel here.
            slot_rows, routed = _slot_rows(row_id_map, spare=rows)
            values = torch.where(routed, probs.reshape(-1), torch.zeros((), dtype=probs.dtype, device=probs.device))
            if rows is None:  # every row is some slot's
                permuted_probs = torch.empty_like(values).scatter_(0, slot_rows, values)
            else:
                permuted_probs = values.new_zeros(rows + 1).scatter_(0, slot_rows, values)[:rows]
        ctx.rows = rows
        ctx.save_for_backward(row_id_map)
        return permuted, permuted_probs

    @staticmethod
    def backward(ctx, grad_permuted, grad_permuted_probs):
        (row_id_map,) = ctx.saved_tensors
        grad_hidden = grad_probs = None
        if ctx.needs_input_grad[0] and grad_permuted is not None:
            grad_hidden = gather_rows(grad_permuted.contiguous(), row_id_map)
        if ctx.needs_input_grad[2] and grad_permuted_probs is not None:
            rows, routed = _slot_rows(row_id_map, spare=None if ctx.rows is None else 0)  # spare: any row in range
            # `where`, not a product with the mask: a dropped copy's row lies past the grouped GEMMs' last group, where
            # the gradient is unspecified (possibly inf/NaN), and NaN * 0 is NaN.
            grad_probs = torch.where(routed, grad_permuted_probs[rows], 0.0).view(row_id_map.shape)
        return grad_hidden, None, grad_probs, None


def permute_rows_again(hidden: torch.Tensor, row_id_map: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """The `permuted` rows of an earlier `permute` whose `row_id_map` is given (and, for a capacity layout, its
    `rows` = E*capacity): its data pass alone, no autograd (to rebuild a dispatch in backward rather than keep it,
    `model.recompute: [moe_dispatch]`)."""
    with torch.no_grad():
        if use_triton(hidden):
            return scatter_rows(hidden.contiguous(), row_id_map, rows=rows)[0]
        T, k = row_id_map.shape
        slot_rows, routed = _slot_rows(row_id_map, spare=rows)
        token = torch.arange(T * k, device=hidden.device) // k
        copies = hidden.index_select(0, token) * routed.unsqueeze(1).to(hidden.dtype)  # as permute_reference
        if rows is None:
            return torch.empty_like(copies).index_copy_(0, slot_rows, copies)
        return copies.new_zeros(rows + 1, copies.shape[1]).index_copy_(0, slot_rows, copies)[:rows]


def permute(hidden: torch.Tensor, indices: torch.Tensor, num_experts: int,
            probs: torch.Tensor | None = None, capacity: int | None = None) -> Permutation:
    """Group token copies by expert (see the module docstring), into blocks of `capacity` rows per expert if given.
    Triton on CUDA, the torch reference on CPU."""
    _check(hidden, indices, num_experts, probs, capacity)
    if not use_triton(hidden):
        return permute_reference(hidden, indices, num_experts, probs, capacity)
    row_id_map, tokens_per_expert, offsets = _row_id_map_triton(indices, num_experts)
    rows = None
    if capacity is not None:
        row_id_map = _into_capacity(row_id_map, indices, offsets, capacity)
        tokens_per_expert, offsets = _capacity_sizes(num_experts, capacity, hidden.device)
        rows = num_experts * capacity
    permuted, permuted_probs = _PermuteFunction.apply(hidden, row_id_map, probs, rows)
    return Permutation(permuted, row_id_map, tokens_per_expert, offsets, permuted_probs)
