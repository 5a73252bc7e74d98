"""Top-k and top-p (nucleus) truncation as one floor per row, found without sorting: the rollout sampler's truncation.

    truncation_floor(logits [B, V], temperature [B] fp32, top_k [B], top_p [B] fp32) -> floor [B] fp32

Row b may draw the tokens whose logit is >= floor[b] (kernels/sample.py `sample_categorical(..., floor=)`):
- top-k (top_k[b] > 0): the k-th largest logit, so the k most likely tokens stay, and every token tied with the k-th;
- top-p (top_p[b] < 1), over what top-k kept, renormalised: the largest logit v such that the tokens >= v hold at least
  top_p of that mass under softmax(logits / temperature). So a token stays when the tokens more likely than it hold
  less than top_p: the nucleus, the most likely token always in it, and a tie group at the boundary kept whole.
A row with top_k 0 and top_p 1 keeps every token (its floor is its smallest logit).

Why no sort: a sort of [256, 151936] logits (a rollout batch over Qwen3's vocabulary) and the passes around it cost a
decode step far more than sampling itself (bench/RESULTS.md). The floor is found instead over the logits'
order-preserving integer keys (the fp32 bits mapped so that integer order is float order; bf16 logits use the top 16
bits alone), in passes of a program per chunk of the row that tally, then a program per row that narrows:
- top-k by radix select, RADIX_BITS of the key a pass from the top: each chunk's histogram of the next digit among the
  keys that share the digits fixed so far (`tl.histogram`, `_digit_tally_kernel`), then the row's digit is the
  largest whose keys at or above still number k (`_digit_narrow_kernel`): 2 passes for 16-bit keys, 4 for 32-bit;
- top-p by a search (a histogram counts, it cannot sum masses): for CANDIDATES keys spread over the remaining interval,
  each chunk sums the mass of its logits at or above each (`_tally_kernel`), then the row keeps the highest candidate
  that still holds top_p of the mass (`_narrow_kernel`) and the interval shrinks CANDIDATES times: 8 passes for 16-bit
  keys, 16 for 32-bit, bound by the comparisons (2, 8 and 16 candidates a pass measured slower than 4).
Each search runs only when a row truncates that way (`use_top_k` / `use_top_p`, known to the caller on the host), so
nothing waits for the device. The torch reference (same contract) sorts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import use_triton
from kernels.sample import splits_for

CANDIDATES = 4  # keys tried per pass: 2 bits of the key a pass (a power of 2; bench/RESULTS.md compares 2 to 16)
TILE = 4096  # comparisons a program accumulates per iteration: it reads TILE / CANDIDATES logits
RADIX_BITS = 8  # key bits a radix-select pass fixes: a histogram of 2^8 bins
RADIX_BLOCK = 4096  # logits a radix-select program reads per iteration (1024 to 8192 measured: 4096 fastest)


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
                  CHUNK: tl.constexpr, SPLITS: tl.constexpr, SHIFT: tl.constexpr, C: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Program (row, split): for the candidate keys lo + j x step (j < C), the mass of the chunk's logits with a key
    at or above each: their sum of exp((x - row max) / t)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    # Candidates past the largest key hold nothing; clamped into int32, they stay past every real logit's key
    cand = tl.minimum(tl.load(lo_ptr + row) + tl.arange(0, C).to(tl.int64) * step, 0x7FFFFFFF).to(tl.int32)
    base = logits_ptr + row.to(tl.int64) * stride
    t = tl.load(temperature_ptr + row)
    inv_t = 1.0 / tl.where(t <= 0, 1.0, t)
    m = tl.load(row_max_ptr + row)
    acc = tl.zeros([BLOCK, C], tl.float32)  # summed over the lanes once, after the loop
    for offset in range(0, CHUNK, BLOCK):
        cols = split * CHUNK + offset + lanes
        inside = cols < V
        x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)
        w = tl.where(inside, tl.exp((x - m) * inv_t), 0.0)
        acc += tl.where(_key(x, SHIFT)[:, None] >= cand[None, :], w[:, None], 0.0)
    tl.store(out_ptr + (row * SPLITS + split) * C + tl.arange(0, C), tl.sum(acc, axis=0))


@triton.jit
def _narrow_kernel(tally_ptr, lo_ptr, top_p_ptr, mass_ptr, step, SPLITS: tl.constexpr, S_BLOCK: tl.constexpr,
                   C: tl.constexpr):
    """Program per row: the tallies summed over the row's chunks; lo moves to the highest candidate that still holds
    top_p of the mass at lo when the search began (kept in `mass_ptr` by the first pass, marked by a negative
    entry)."""
    row = tl.program_id(0)
    splits = tl.arange(0, S_BLOCK)
    j = tl.arange(0, C)
    tally = tl.load(tally_ptr + (row * SPLITS + splits[:, None]) * C + j[None, :], mask=(splits < SPLITS)[:, None],
                    other=0.0)
    held = tl.sum(tally, axis=0)
    top_p = tl.load(top_p_ptr + row)
    total = tl.load(mass_ptr + row)
    total = tl.where(total < 0, tl.sum(tl.where(j == 0, held, 0.0), axis=0), total)  # first pass: mass at lo
    tl.store(mass_ptr + row, total)
    holds = (j == 0) | (held >= tl.where(top_p < 1, top_p * total, float("inf")))  # top_p 1: lo stays
    top = tl.max(tl.where(holds, j, 0), axis=0)
    tl.store(lo_ptr + row, tl.load(lo_ptr + row) + top.to(tl.int64) * step)


@triton.jit
def _digit_tally_kernel(logits_ptr, prefix_ptr, out_ptr, V: tl.constexpr, stride, CHUNK: tl.constexpr,
                        SPLITS: tl.constexpr, SHIFT: tl.constexpr, DIGIT: tl.constexpr, BITS: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Program (row, split): the histogram of key digit (key >> DIGIT) mod 2^BITS over the chunk's logits whose key
    shares the row's fixed digits above it (`prefix`: the unsigned key, `_keys` + 2^(31 - SHIFT), its digits below
    DIGIT + BITS still 0): `_key`'s with its sign bit flipped, as uint32, so that shifts are logical."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    TOP: tl.constexpr = DIGIT + BITS >= 32 - SHIFT  # the first pass: no digit fixed yet
    high = (tl.load(prefix_ptr + row) >> (DIGIT + BITS)).to(tl.uint32)
    base = logits_ptr + row.to(tl.int64) * stride
    counts = tl.zeros([1 << BITS], tl.int32)
    for offset in range(0, CHUNK, BLOCK):
        cols = split * CHUNK + offset + lanes
        inside = cols < V
        x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
        key = (_key(x, 0) ^ -2147483648).to(tl.uint32, bitcast=True) >> SHIFT  # the sign bit flipped: unsigned order
        digit = ((key >> DIGIT) & ((1 << BITS) - 1)).to(tl.int32)
        if TOP:
            fixed = inside
        else:
            fixed = inside & ((key >> (DIGIT + BITS)) == high)
        counts += tl.histogram(digit, 1 << BITS, mask=fixed)
    tl.store(out_ptr + (row * SPLITS + split) * (1 << BITS) + tl.arange(0, 1 << BITS), counts)


@triton.jit
def _digit_narrow_kernel(tally_ptr, prefix_ptr, need_ptr, SPLITS: tl.constexpr, S_BLOCK: tl.constexpr,
                         DIGIT: tl.constexpr, BITS: tl.constexpr):
    """Program per row: the chunks' histograms summed; the row's digit at DIGIT is the largest whose keys at or above
    (within the fixed digits) still number `need`; `need` drops by the keys above that digit."""
    row = tl.program_id(0)
    splits = tl.arange(0, S_BLOCK)
    d = tl.arange(0, 1 << BITS)
    tally = tl.load(tally_ptr + (row * SPLITS + splits[:, None]) * (1 << BITS) + d[None, :],
                    mask=(splits < SPLITS)[:, None], other=0)
    per_digit = tl.sum(tally, axis=0)
    at_or_above = tl.sum(per_digit, axis=0) - tl.cumsum(per_digit, axis=0) + per_digit
    need = tl.load(need_ptr + row)
    chosen = tl.sum((at_or_above >= need).to(tl.int32), axis=0) - 1  # non-increasing: the last digit that holds
    above = tl.sum(tl.where(d == chosen, at_or_above - per_digit, 0), axis=0)
    tl.store(need_ptr + row, need - above)
    tl.store(prefix_ptr + row, tl.load(prefix_ptr + row) | (chosen.to(tl.int64) << DIGIT))


def _radix_select(logits: torch.Tensor, k: torch.Tensor, shift: int) -> torch.Tensor:
    """The key [B] int64 of each row's k[b]-th largest logit (1 <= k[b] <= V), RADIX_BITS a pass from the top."""
    B, V = logits.shape
    splits, chunk = splits_for(B, V, RADIX_BLOCK)
    bins = 1 << RADIX_BITS
    tally = torch.empty(B, splits, bins, dtype=torch.int32, device=logits.device)
    prefix = torch.zeros(B, dtype=torch.int64, device=logits.device)
    need = k.to(torch.int32).contiguous()
    for digit in range(32 - shift - RADIX_BITS, -1, -RADIX_BITS):
        _digit_tally_kernel[(B, splits)](logits, prefix, tally, V, logits.stride(0), CHUNK=chunk, SPLITS=splits,
                                         SHIFT=shift, DIGIT=digit, BITS=RADIX_BITS, BLOCK=RADIX_BLOCK,
                                         num_warps=4)
        _digit_narrow_kernel[(B,)](tally, prefix, need, SPLITS=splits, S_BLOCK=max(2, triton.next_power_of_2(splits)),
                                   DIGIT=digit, BITS=RADIX_BITS, num_warps=4)
    return prefix - (1 << (31 - shift))  # the signed key


def _nucleus_search(logits, temperature, row_max, lo, top_p, shift: int) -> None:
    """Moves `lo` [B] int64 (a key whose logits at or above hold all the mass kept: top-k's floor) to the highest key
    whose logits at or above still hold top_p of it, log2(CANDIDATES) bits a pass; rows split over programs as the
    sampler's (`splits_for`)."""
    B, V = logits.shape
    block = TILE // CANDIDATES
    splits, chunk = splits_for(B, V, block)
    tally = torch.empty(B, splits, CANDIDATES, dtype=torch.float32, device=logits.device)
    total = torch.full((B,), -1.0, dtype=torch.float32, device=logits.device)
    span = 1 << (32 - shift)
    while span > 1:
        step = max(1, span // CANDIDATES)  # candidates past the interval (a last, smaller pass) hold nothing
        _tally_kernel[(B, splits)](logits, temperature, row_max, lo, tally, step, V, logits.stride(0), CHUNK=chunk,
                                   SPLITS=splits, SHIFT=shift, C=CANDIDATES, BLOCK=block, num_warps=4)
        _narrow_kernel[(B,)](tally, lo, top_p, total, step, SPLITS=splits,
                             S_BLOCK=max(2, triton.next_power_of_2(splits)), C=CANDIDATES, num_warps=1)
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
    if use_top_k:
        k = top_k.long()
        lo = _radix_select(logits, torch.where((k > 0) & (k < V), k, V), shift)
    else:
        lo = _keys(logits.amin(dim=1).float(), shift)
    if use_top_p:
        row_max = logits.amax(dim=1).float()
        _nucleus_search(logits, temperature, row_max, lo, top_p.float().contiguous(), shift)
    return _value_of(lo, shift)

