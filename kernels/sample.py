"""One token per row from the softmax of temperature-scaled logits, and its log-probability: the rollout's sampler.

    sample_categorical(logits [B, V], temperature [B] fp32, seed [1] int64, floor [B] fp32 | None)
        -> (tokens [B] int64, logprobs [B] fp32)

Row b samples from p = softmax(logits[b] / temperature[b]) by inverting its cumulative distribution: with u uniform in
[0, 1), the first token whose cumulative probability exceeds u. Its log-prob is logits[tok] / t - logsumexp(logits / t).
A row with temperature <= 0 is greedy: the first maximal logit, its log-prob under t = 1. `seed` (on the logits'
device, drawn from the caller's generator) makes a call reproducible. With `floor` (top-k / top-p truncation,
kernels/truncation.py) row b draws from p restricted to the logits >= floor[b] and renormalised; the log-prob stays
that of the whole distribution p (the density the trainer recomputes: services/rl_rollout/sampling.py).

Why a kernel: torch's path over [256, 151936] fp32 logits (a rollout batch of Qwen3's vocabulary) makes eight full
passes (cast, divide, log_softmax, softmax, and inside `torch.multinomial` an exponential draw, a divide, an argmax and
a check), ~1.0 ms a decode step on an H200 (bench/RESULTS.md). Here two kernels read the logits about once:
- `_chunk_kernel`, a program per chunk of a row (`splits_for`: enough programs to fill the GPU whatever the batch):
  the chunk's max, its first maximal column, and its sum of exp(x - max) (online softmax per lane);
- `_select_kernel`, a program per row: the log-sum-exp over its chunks; a greedy row's token from the chunks' maxima
  and first maximal columns; a sampled row's from one uniform (Triton's Philox keyed by the row), the chunk where
  u x total falls, then a cumulative sum along that one chunk to the token.
One uniform per row and an exp per logit, where a Gumbel-max draw needs a Philox draw and two logs per logit (which
made an earlier version of this kernel compute-bound at a third of the memory's rate). The token is the same for any
split of the row (the cumulative distribution runs over the columns in order), up to fp32 rounding at a boundary. The
torch reference (same contract and method, its uniform from torch's generator seeded with `seed`) draws other tokens
for one seed: the tests compare distributions, and greedy tokens and log-probs exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import use_triton

BLOCK_V = 2048  # logits a program reads per iteration
PROGRAMS = 4096  # programs to aim for over a batch: each row's columns are split in chunks until about this many


def _check(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, floor: torch.Tensor | None) -> None:
    rows = (logits.shape[0],) if logits.dim() == 2 else None
    if rows is None or temperature.shape != rows or (floor is not None and floor.shape != rows):
        raise ValueError(f"sample_categorical wants logits [B, V], temperature [B] and floor [B] or None, got "
                         f"{tuple(logits.shape)}, {tuple(temperature.shape)} and "
                         f"{None if floor is None else tuple(floor.shape)}")
    if seed.shape != (1,) or seed.dtype != torch.int64:
        raise ValueError(f"sample_categorical wants seed as an int64 tensor of shape [1], got {seed.dtype} "
                         f"{tuple(seed.shape)}")


def sample_categorical_reference(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                                 floor: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `sample_categorical`, in torch ops (the uniforms from torch's generator seeded with `seed`)."""
    _check(logits, temperature, seed, floor)
    greedy = temperature <= 0
    scaled = logits.float() / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    generator = torch.Generator(logits.device).manual_seed(int(seed.item()))
    u = torch.rand(scaled.shape[0], device=logits.device, generator=generator)
    kept = scaled if floor is None else scaled.masked_fill(logits.float() < floor[:, None], float("-inf"))
    cdf = torch.softmax(kept, dim=-1).cumsum(dim=-1)
    # u x total rather than u: a total rounded below 1 must not leave u past the last token
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1).clamp(max=scaled.shape[1] - 1)
    tokens = torch.where(greedy, scaled.argmax(dim=-1), drawn)
    logprobs = scaled.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(scaled, dim=-1)
    return tokens, logprobs


@triton.jit
def _chunk_kernel(logits_ptr, temperature_ptr, floor_ptr, max_ptr, col_ptr, sum_ptr, kept_ptr, V: tl.constexpr,
                  stride, CHUNK: tl.constexpr, SPLITS: tl.constexpr, TRUNCATE: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, split): columns [split * CHUNK, (split + 1) * CHUNK) of the row, scaled by 1 / t. Writes the
    chunk's max, its first column at the max, and the sum of exp(x - max) over the chunk; with TRUNCATE also that sum
    over the columns whose logit is >= the row's floor."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    t = tl.load(temperature_ptr + row)
    inv_t = 1.0 / tl.where(t <= 0, 1.0, t)
    lanes = tl.arange(0, BLOCK)
    base = logits_ptr + row.to(tl.int64) * stride
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: online softmax over its columns
    run_sum = tl.zeros([BLOCK], tl.float32)
    run_kept = tl.zeros([BLOCK], tl.float32)
    max_col = tl.full([BLOCK], V, tl.int32)  # per lane: first column at its max (V: none yet)
    if TRUNCATE:
        floor = tl.load(floor_ptr + row)
    for offset in range(0, CHUNK, BLOCK):
        cols = split * CHUNK + offset + lanes
        inside = cols < V
        raw = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)
        x = raw * inv_t
        max_col = tl.where(inside & (x > run_max), cols, max_col)  # strictly: a lane keeps its first column on a tie
        new_max = tl.maximum(run_max, x)
        # exp(-inf - -inf) is nan: lanes still at -inf add nothing
        scale = tl.exp(run_max - new_max)
        e = tl.exp(x - new_max)
        run_sum = tl.where(new_max == float("-inf"), 0.0, run_sum * scale + e)
        if TRUNCATE:
            run_kept = tl.where(new_max == float("-inf"), 0.0, run_kept * scale + tl.where(raw >= floor, e, 0.0))
        run_max = new_max
    m = tl.max(run_max, axis=0)
    out = row * SPLITS + split
    tl.store(max_ptr + out, m)
    tl.store(col_ptr + out, tl.min(tl.where(run_max == m, max_col, V), axis=0))
    lane_scale = tl.where(run_max == float("-inf"), 0.0, tl.exp(run_max - m))
    tl.store(sum_ptr + out, tl.sum(run_sum * lane_scale, axis=0))
    if TRUNCATE:
        tl.store(kept_ptr + out, tl.sum(run_kept * lane_scale, axis=0))


@triton.jit
def _select_kernel(logits_ptr, temperature_ptr, seed_ptr, floor_ptr, max_ptr, col_ptr, sum_ptr, kept_ptr, tokens_ptr,
                   logprobs_ptr, V: tl.constexpr, stride, CHUNK: tl.constexpr, SPLITS: tl.constexpr,
                   S_BLOCK: tl.constexpr, TRUNCATE: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: the log-sum-exp over the row's chunks, then the greedy token (the first column at the row's
    max, from the chunks' own) or, for a sampled row only, the drawn one: the chunk where u x total (of the kept mass,
    with TRUNCATE) falls, then the column within it."""
    row = tl.program_id(0)
    t = tl.load(temperature_ptr + row)
    greedy = t <= 0
    inv_t = 1.0 / tl.where(greedy, 1.0, t)
    chunks = tl.arange(0, S_BLOCK)
    at = row * SPLITS + chunks
    real = chunks < SPLITS
    chunk_max = tl.load(max_ptr + at, mask=real, other=float("-inf"))
    m = tl.max(chunk_max, axis=0)
    weight = tl.where(chunk_max == float("-inf"), 0.0,
                      tl.load(sum_ptr + at, mask=real, other=0.0) * tl.exp(chunk_max - m))  # mass, in units of e^m
    lse = m + tl.log(tl.sum(weight, axis=0))
    if TRUNCATE:  # the draw runs over the kept columns' mass; the log-prob stays the whole distribution's
        floor = tl.load(floor_ptr + row)
        weight = tl.where(chunk_max == float("-inf"), 0.0,
                          tl.load(kept_ptr + at, mask=real, other=0.0) * tl.exp(chunk_max - m))
    total = tl.sum(weight, axis=0)
    base = logits_ptr + row.to(tl.int64) * stride
    if greedy:  # one row a program, so no divergence: a greedy row skips the draw and the scan of a chunk
        token = tl.min(tl.where(chunk_max == m, tl.load(col_ptr + at, mask=real, other=V), V), axis=0)
    else:
        # The chunk holding u x total: the first whose cumulative mass exceeds it (the last with mass, if rounding
        # left u x total at or past the sum), and what remains of it within the chunk, in units of e^(chunk max).
        target = tl.rand(tl.load(seed_ptr), row) * total
        through = tl.cumsum(weight, axis=0)
        chunk = tl.min(tl.where(through > target, chunks, S_BLOCK), axis=0)
        chunk = tl.where(chunk == S_BLOCK, tl.max(tl.where(weight > 0, chunks, 0), axis=0), chunk)
        here = chunks == chunk
        c_max = tl.sum(tl.where(here, chunk_max, 0.0), axis=0)
        rest = (target - tl.sum(tl.where(here, through - weight, 0.0), axis=0)) / tl.exp(c_max - m)
        lanes = tl.arange(0, BLOCK)
        before = 0.0  # mass of the chunk's columns before this block
        drawn = V  # the first column where the running mass passes `rest` (V: not yet)
        last = 0  # the last column with mass (rounding may leave `rest` at or past the chunk's recomputed sum)
        for offset in range(0, CHUNK, BLOCK):
            cols = chunk * CHUNK + offset + lanes
            inside = cols < V
            raw = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)
            x = raw * inv_t
            drawable = inside & (x > float("-inf"))
            if TRUNCATE:
                drawable = drawable & (raw >= floor)
            p = tl.where(drawable, tl.exp(x - c_max), 0.0)
            running = before + tl.cumsum(p, axis=0)
            drawn = tl.minimum(drawn, tl.min(tl.where((running > rest) & (p > 0), cols, V), axis=0))
            last = tl.maximum(last, tl.max(tl.where(p > 0, cols, 0), axis=0))
            before = before + tl.sum(p, axis=0)
        token = tl.where(drawn == V, last, drawn)
    x_token = tl.load(base + token).to(tl.float32) * inv_t
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, x_token - lse)


def splits_for(rows: int, vocab: int, block: int | None = None) -> tuple[int, int]:
    """(splits, chunk): each row's columns in `splits` chunks of `chunk` (a multiple of `block`, default BLOCK_V),
    enough for about PROGRAMS programs in all: few rows get many chunks each, many rows few. kernels/truncation.py
    splits its rows by it too."""
    block = block or BLOCK_V
    blocks = triton.cdiv(vocab, block)
    splits = min(blocks, max(1, triton.cdiv(PROGRAMS, max(rows, 1))))
    chunk = triton.cdiv(blocks, splits) * block
    return triton.cdiv(vocab, chunk), chunk


def sample_categorical(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                       floor: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and their log-probs (module docstring). Triton on CUDA, the torch reference on CPU."""
    _check(logits, temperature, seed, floor)
    if not use_triton(logits):
        return sample_categorical_reference(logits, temperature, seed, floor)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    B, V = logits.shape
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    if B:
        temperature = temperature.float().contiguous()
        splits, chunk = splits_for(B, V)
        truncate = floor is not None
        if truncate:
            floor = floor.float().contiguous()
        chunk_max, chunk_sum, chunk_kept = torch.empty(3, B, splits, dtype=torch.float32, device=logits.device)
        cols = torch.empty(B, splits, dtype=torch.int32, device=logits.device)
        _chunk_kernel[(B, splits)](logits, temperature, floor, chunk_max, cols, chunk_sum, chunk_kept, V,
                                   logits.stride(0), CHUNK=chunk, SPLITS=splits, TRUNCATE=truncate, BLOCK=BLOCK_V,
                                   num_warps=8)
        _select_kernel[(B,)](logits, temperature, seed, floor, chunk_max, cols, chunk_sum, chunk_kept, tokens,
                             logprobs, V, logits.stride(0), CHUNK=chunk, SPLITS=splits,
                             S_BLOCK=max(2, triton.next_power_of_2(splits)), TRUNCATE=truncate, BLOCK=BLOCK_V,
                             num_warps=8)
    return tokens, logprobs
