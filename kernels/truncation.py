"""Top-k and top-p (nucleus) truncation as one floor per row, found without sorting: the rollout sampler's truncation.

    truncation_floor(logits [B, V], temperature [B] fp32, top_k [B], top_p [B] fp32) -> floor [B] fp32

Row b may draw the tokens whose logit is >= floor[b] (kernels/sample.py `sample_categorical(..., floor=)`):
- top-k (top_k[b] > 0): the k-th largest logit, so the k most likely tokens stay, and every token tied with the k-th;
- top-p (top_p[b] < 1), over what top-k kept, renormalised: the largest logit v such that the tokens >= v hold at least
  top_p of that mass under softmax(logits / temperature). So a token stays when the tokens more likely than it hold
  less than top_p: the nucleus, the most likely token always in it, and a tie group at the boundary kept whole.
A row with top_k 0 and top_p 1 keeps every token (its floor is its smallest logit).

Why no sort: a sort of [256, 151936] logits (a rollout batch over Qwen3's vocabulary) and the passes around it cost a
decode step far more than sampling itself (bench/RESULTS.md). The floor is a search instead, over the logits'
order-preserving integer keys (the fp32 bits mapped so that integer order is float order; bf16 logits use the top 16
bits alone): each pass counts, for CANDIDATES keys spread over the remaining interval, the row's logits at or above
each (top-k) or their mass (top-p), in a program per chunk of the row (`_tally_kernel`), then one program per row keeps
the highest candidate that still holds k tokens or top_p of the mass (`_narrow_kernel`) and the interval shrinks
CANDIDATES times. With 4 candidates, 16-bit keys take 8 passes and 32-bit keys 16, per search; top-k's search runs
only when a row truncates by top-k (`use_top_k`, known to the caller on the host) and top-p's likewise, so nothing
waits for the device. Each pass is bound by its comparisons, not by reading the logits: 2, 8 and 16 candidates a pass
measured slower than 4. The torch reference (same contract) sorts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import use_triton
from kernels.sample import splits_for

CANDIDATES = 4  # keys tried per pass: 2 bits of the key a pass (a power of 2; bench/RESULTS.md compares 2 to 16)
TILE = 4096  # comparisons a program accumulates per iteration: it reads TILE / CANDIDATES logits


def _check(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    B = logits.shape[0] if logits.dim() == 2 else -1
    if logits.dim() != 2 or any(t.shape != (B,) for t in (temperature, top_k, top_p)):
        raise ValueError(f"truncation_floor wants logits [B, V] and temperature, top_k, top_p [B], got "
                         f"{tuple(logits.shape)}, {tuple(temperature.shape)}, {tuple(top_k.shape)}, "
                         f"{tuple(top_p.shape)}")


def truncation_floor_reference(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                               top_p: torch.Tensor, use_top_k: bool = True, use_top_p: bool = True) -> torch.Tensor:
    """Same contract as `truncation_floor`, by a sort of each row."""
    _check(logits, temperature, top_k, top_p)
    B, V = logits.shape
    values = logits.float().sort(dim=-1, descending=True).values
    rows = torch.arange(B, device=logits.device)
    k = top_k.long()
    k = torch.where((k > 0) & (k < V) & use_top_k, k, V)
    floor = values[rows, k - 1]
    if use_top_p:
        t = torch.where(temperature <= 0, torch.ones_like(temperature), temperature.float())
        mass = torch.exp((values - values[:, :1]) / t[:, None]).masked_fill(values < floor[:, None], 0.0)
        running = mass.cumsum(dim=-1)
        reach = running >= top_p.float()[:, None] * running[:, -1:]  # the last always reaches: top_p <= 1
        nucleus = values[rows, reach.float().argmax(dim=-1)]  # the first value whose running mass reaches top_p
        floor = torch.where(top_p < 1, torch.maximum(floor, nucleus), floor)
    return floor


@triton.jit
def _key(x, SHIFT: tl.constexpr):
    """Order-preserving int32 key of fp32 `x`: `_keys` in Triton."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF) >> SHIFT


@triton.jit
def _tally_kernel(logits_ptr, temperature_ptr, row_max_ptr, lo_ptr, out_ptr, step, V: tl.constexpr, stride,
                  CHUNK: tl.constexpr, SPLITS: tl.constexpr, MASS: tl.constexpr, SHIFT: tl.constexpr,
                  C: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, split): for the candidate keys lo + j x step (j < C), the chunk's logits with a key at or above
    each: their count, or (MASS) their sum of exp((x - row max) / t)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    # Candidates past the largest key hold nothing; clamped into int32, they stay past every real logit's key
    cand = tl.minimum(tl.load(lo_ptr + row) + tl.arange(0, C).to(tl.int64) * step, 0x7FFFFFFF).to(tl.int32)
    base = logits_ptr + row.to(tl.int64) * stride
    if MASS:
        t = tl.load(temperature_ptr + row)
        inv_t = 1.0 / tl.where(t <= 0, 1.0, t)
        m = tl.load(row_max_ptr + row)
    acc = tl.zeros([BLOCK, C], tl.float32)  # summed over the lanes once, after the loop
    for offset in range(0, CHUNK, BLOCK):
        cols = split * CHUNK + offset + lanes
        inside = cols < V
        x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)
        if MASS:
            w = tl.where(inside, tl.exp((x - m) * inv_t), 0.0)
        else:
            w = tl.where(inside, 1.0, 0.0)
        acc += tl.where(_key(x, SHIFT)[:, None] >= cand[None, :], w[:, None], 0.0)
    tl.store(out_ptr + (row * SPLITS + split) * C + tl.arange(0, C), tl.sum(acc, axis=0))


@triton.jit
def _narrow_kernel(tally_ptr, lo_ptr, need_ptr, mass_ptr, step, SPLITS: tl.constexpr, S_BLOCK: tl.constexpr,
                   MASS: tl.constexpr, C: tl.constexpr):
    """Program per row: the tallies summed over the row's chunks; lo moves to the highest candidate that still holds
    `need` tokens (count) or top_p of the mass at lo when the search began (MASS; that mass is kept in `mass_ptr` by
    the first pass, marked by a negative entry)."""
    row = tl.program_id(0)
    splits = tl.arange(0, S_BLOCK)
    j = tl.arange(0, C)
    tally = tl.load(tally_ptr + (row * SPLITS + splits[:, None]) * C + j[None, :], mask=(splits < SPLITS)[:, None],
                    other=0.0)
    held = tl.sum(tally, axis=0)
    need = tl.load(need_ptr + row)
    if MASS:
        total = tl.load(mass_ptr + row)
        total = tl.where(total < 0, tl.sum(tl.where(j == 0, held, 0.0), axis=0), total)  # first pass: mass at lo
        tl.store(mass_ptr + row, total)
        holds = (j == 0) | (held >= tl.where(need < 1, need * total, float("inf")))  # top_p 1: lo stays
    else:
        holds = (j == 0) | (held >= need)
    top = tl.max(tl.where(holds, j, 0), axis=0)
    tl.store(lo_ptr + row, tl.load(lo_ptr + row) + top.to(tl.int64) * step)


def _search(logits, temperature, row_max, lo, need, mass: bool, shift: int) -> None:
    """Moves `lo` [B] int64 (a key that holds) to the highest key that holds, log2(CANDIDATES) bits a pass; rows
    split over programs as the sampler's (`splits_for`)."""
    B, V = logits.shape
    block = TILE // CANDIDATES
    splits, chunk = splits_for(B, V, block)
    tally = torch.empty(B, splits, CANDIDATES, dtype=torch.float32, device=logits.device)
    total = torch.full((B,), -1.0, dtype=torch.float32, device=logits.device)
    span = 1 << (32 - shift)
    while span > 1:
        step = max(1, span // CANDIDATES)  # candidates past the interval (a last, smaller pass) hold nothing
        _tally_kernel[(B, splits)](logits, temperature, row_max, lo, tally, step, V, logits.stride(0), CHUNK=chunk,
                                   SPLITS=splits, MASS=mass, SHIFT=shift, C=CANDIDATES, BLOCK=block, num_warps=4)
        _narrow_kernel[(B,)](tally, lo, need, total, step, SPLITS=splits, S_BLOCK=max(2, triton.next_power_of_2(splits)),
                             MASS=mass, C=CANDIDATES, num_warps=1)
        span = step


def _keys(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Order-preserving integer keys of fp32 `x` (int64, in int32's range): a float's bits as a signed integer, the
    magnitude bits of a negative one flipped (so that a larger magnitude is a smaller integer), shifted right by
    `shift` (the low bits dropped: all 0 for a positive bf16 value, all 1 for a negative one)."""
    bits = x.view(torch.int32)
    return (torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF) >> shift).long()


def _value_of(key: torch.Tensor, shift: int) -> torch.Tensor:
    """fp32 values of int64 keys: the inverse of `_keys`."""
    full = key << shift
    if shift:
        full = torch.where(full < 0, full + (1 << shift) - 1, full)  # a negative value's dropped low bits
    return torch.where(full >= 0, full, full ^ 0x7FFFFFFF).to(torch.int32).view(torch.float32)


def truncation_floor(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     use_top_k: bool = True, use_top_p: bool = True) -> torch.Tensor:
    """The floor of each row's truncated support (module docstring). `use_top_k` / `use_top_p`: whether any row
    truncates that way (host knowledge; False skips that search, as if every row had top_k 0 / top_p 1). Triton on
    CUDA, the torch reference on CPU."""
    _check(logits, temperature, top_k, top_p)
    if not use_triton(logits):
        return truncation_floor_reference(logits, temperature, top_k, top_p, use_top_k, use_top_p)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    B, V = logits.shape
    if B == 0:
        return torch.empty(0, dtype=torch.float32, device=logits.device)
    shift = 16 if logits.dtype == torch.bfloat16 else 0  # bf16 is the top half of fp32: its low 16 key bits are 0
    temperature = temperature.float().contiguous()
    lo = torch.full((B,), -(1 << (31 - shift)), dtype=torch.int64, device=logits.device)  # the lowest key holds
    if use_top_k:
        k = top_k.float()
        _search(logits, temperature, None, lo, torch.where((k > 0) & (k < V), k, V).contiguous(), False, shift)
    else:
        lo = _keys(logits.amin(dim=1).float(), shift)
    if use_top_p:
        row_max = logits.amax(dim=1).float()
        _search(logits, temperature, row_max, lo, top_p.float().contiguous(), True, shift)
    return _value_of(lo, shift)

