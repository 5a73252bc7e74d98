"""One token per row from the softmax of temperature-scaled logits, and its log-probability: the rollout's sampler.

    sample_categorical(logits [B, V], temperature [B] fp32, seed [1] int64) -> (tokens [B] int64, logprobs [B] fp32)

Row b samples from softmax(logits[b] / temperature[b]) by the Gumbel-max trick: the token maximising
logits / t + g, with g = -log(-log(u)) and u uniform in [0, 1), is distributed exactly as that softmax. Its log-prob is
logits[tok] / t - logsumexp(logits / t). A row with temperature <= 0 is greedy: the first maximal logit, its log-prob
under t = 1. `seed` (on the logits' device, drawn from the caller's generator) makes a call reproducible.

Why a kernel: torch's path over [256, 151936] fp32 logits (a rollout batch of Qwen3's vocabulary) makes eight full
passes (cast, divide, log_softmax, softmax, and inside `torch.multinomial` an exponential draw, a divide, an argmax and
a check), ~1.1 ms a decode step on an H100 (bench/RESULTS.md). Here the logits are read once: each row's columns are
split in chunks (`splits_for`: enough programs to fill the GPU whatever the batch), a program per chunk keeps a running
max and sum (online softmax) and each lane's best noisy score, and a second kernel combines a row's chunks. The uniform
of (row, column) comes from Triton's Philox (`tl.rand`) keyed by the two, so the split does not change the draw; the
kernel and the torch reference (same contract, torch's generator seeded with `seed`) draw different tokens for one
seed: the tests compare their distributions, and their log-probs and greedy tokens exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import use_triton

BLOCK_V = 2048  # logits a program reads per iteration
PROGRAMS = 1024  # programs to aim for over a batch: each row's columns are split in chunks until about this many


def _check(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor) -> None:
    if logits.dim() != 2 or temperature.shape != (logits.shape[0],):
        raise ValueError(f"sample_categorical wants logits [B, V] and temperature [B], got {tuple(logits.shape)} and "
                         f"{tuple(temperature.shape)}")
    if seed.shape != (1,) or seed.dtype != torch.int64:
        raise ValueError(f"sample_categorical wants seed as an int64 tensor of shape [1], got {seed.dtype} "
                         f"{tuple(seed.shape)}")


def sample_categorical_reference(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `sample_categorical`, in torch ops (the uniforms from torch's generator seeded with `seed`)."""
    _check(logits, temperature, seed)
    greedy = temperature <= 0
    scaled = logits.float() / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    generator = torch.Generator(logits.device).manual_seed(int(seed.item()))
    u = torch.rand(scaled.shape, device=logits.device, generator=generator)
    noisy = torch.where(greedy[:, None], scaled, scaled - torch.log(-torch.log(u)))
    tokens = noisy.argmax(dim=-1)
    logprobs = scaled.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(scaled, dim=-1)
    return tokens, logprobs


@triton.jit
def _sample_chunk_kernel(logits_ptr, temperature_ptr, seed_ptr, best_ptr, col_ptr, scaled_ptr, max_ptr, sum_ptr,
                         V: tl.constexpr, stride, CHUNK: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, split): columns [split * CHUNK, (split + 1) * CHUNK) of the row. Writes the chunk's best noisy
    score, its column and scaled logit, and the chunk's running max and sum of exp (online softmax)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    t = tl.load(temperature_ptr + row)
    greedy = t <= 0
    inv_t = 1.0 / tl.where(greedy, 1.0, t)
    seed = tl.load(seed_ptr)
    lanes = tl.arange(0, BLOCK)
    base = logits_ptr + row.to(tl.int64) * stride
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: online softmax over its columns
    run_sum = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: best noisy score, its column and scaled logit
    best_col = tl.full([BLOCK], V, tl.int32)  # V: no column yet (lanes past the row's end)
    best_scaled = tl.zeros([BLOCK], tl.float32)
    for offset in range(0, CHUNK, BLOCK):
        cols = split * CHUNK + offset + lanes
        inside = cols < V
        x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32) * inv_t
        new_max = tl.maximum(run_max, x)
        # exp(-inf - -inf) is nan: lanes still at -inf add nothing
        run_sum = tl.where(new_max == float("-inf"), 0.0,
                           run_sum * tl.exp(run_max - new_max) + tl.exp(x - new_max))
        run_max = new_max
        u = tl.rand(seed, row.to(tl.int64) * V + cols)  # the uniform of (row, column), whatever the split
        noisy = tl.where(greedy, x, x - tl.log(-tl.log(u)))
        better = inside & (noisy > best)  # strictly: a lane keeps its first column on a tie
        best = tl.where(better, noisy, best)
        best_col = tl.where(better, cols, best_col)
        best_scaled = tl.where(better, x, best_scaled)
    top = tl.max(best, axis=0)
    col = tl.min(tl.where(best == top, best_col, V), axis=0)  # the first column among the lanes at the top
    m = tl.max(run_max, axis=0)
    out = row * SPLITS + split
    tl.store(best_ptr + out, top)
    tl.store(col_ptr + out, col)
    tl.store(scaled_ptr + out, tl.max(tl.where(best_col == col, best_scaled, float("-inf")), axis=0))
    tl.store(max_ptr + out, m)
    tl.store(sum_ptr + out, tl.sum(tl.where(run_max == float("-inf"), 0.0, run_sum * tl.exp(run_max - m)), axis=0))


@triton.jit
def _sample_combine_kernel(best_ptr, col_ptr, scaled_ptr, max_ptr, sum_ptr, tokens_ptr, logprobs_ptr,
                           V: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: the best of its chunks (the first column on a tie) and the log-sum-exp over them."""
    row = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    inside = lanes < SPLITS
    at = row * SPLITS + lanes
    best = tl.load(best_ptr + at, mask=inside, other=float("-inf"))
    cols = tl.load(col_ptr + at, mask=inside, other=V)
    top = tl.max(best, axis=0)
    col = tl.min(tl.where(best == top, cols, V), axis=0)
    picked = tl.max(tl.where(cols == col, tl.load(scaled_ptr + at, mask=inside, other=float("-inf")),
                             float("-inf")), axis=0)
    chunk_max = tl.load(max_ptr + at, mask=inside, other=float("-inf"))
    m = tl.max(chunk_max, axis=0)
    total = tl.sum(tl.where(chunk_max == float("-inf"), 0.0,
                            tl.load(sum_ptr + at, mask=inside, other=0.0) * tl.exp(chunk_max - m)), axis=0)
    tl.store(tokens_ptr + row, col.to(tl.int64))
    tl.store(logprobs_ptr + row, picked - (m + tl.log(total)))


def splits_for(rows: int, vocab: int) -> tuple[int, int]:
    """(splits, chunk): each row's columns in `splits` chunks of `chunk` (a multiple of BLOCK_V), enough for about
    PROGRAMS programs in all: few rows get many chunks each, many rows few."""
    blocks = triton.cdiv(vocab, BLOCK_V)
    splits = min(blocks, max(1, triton.cdiv(PROGRAMS, max(rows, 1))))
    chunk = triton.cdiv(blocks, splits) * BLOCK_V
    return triton.cdiv(vocab, chunk), chunk


def sample_categorical(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and their log-probs (module docstring). Triton on CUDA, the torch reference on CPU."""
    _check(logits, temperature, seed)
    if not use_triton(logits):
        return sample_categorical_reference(logits, temperature, seed)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    B, V = logits.shape
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    if B:
        splits, chunk = splits_for(B, V)
        best, scaled, chunk_max, chunk_sum = torch.empty(4, B, splits, dtype=torch.float32, device=logits.device)
        cols = torch.empty(B, splits, dtype=torch.int32, device=logits.device)
        _sample_chunk_kernel[(B, splits)](logits, temperature.float().contiguous(), seed, best, cols, scaled, chunk_max,
                                          chunk_sum, V, logits.stride(0), CHUNK=chunk, SPLITS=splits, BLOCK=BLOCK_V,
                                          num_warps=8)
        _sample_combine_kernel[(B,)](best, cols, scaled, chunk_max, chunk_sum, tokens, logprobs, V, SPLITS=splits,
                                     BLOCK=triton.next_power_of_2(splits))
    return tokens, logprobs
