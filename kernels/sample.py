"""One token per row from the softmax of temperature-scaled logits, and its log-probability: the rollout's sampler.

    sample_categorical(logits [B, V], temperature [B] fp32, seed [1] int64) -> (tokens [B] int64, logprobs [B] fp32)

Row b samples from softmax(logits[b] / temperature[b]) by the Gumbel-max trick: the token maximising
logits / t + g, with g = -log(-log(u)) and u uniform in [0, 1), is distributed exactly as that softmax. Its log-prob is
logits[tok] / t - logsumexp(logits / t). A row with temperature <= 0 is greedy: the first maximal logit, its log-prob
under t = 1. `seed` (on the logits' device, drawn from the caller's generator) makes a call reproducible.

Why a kernel: torch's path over [256, 151936] fp32 logits (a rollout batch of Qwen3's vocabulary) makes eight full
passes (cast, divide, log_softmax, softmax, and inside `torch.multinomial` an exponential draw, a divide, an argmax and
a check), ~1.1 ms a decode step on an H100 (bench/RESULTS.md). One program per row reads its logits once, keeping a
running max and sum (online softmax) and each lane's best noisy score. The uniforms come from Triton's Philox
(`tl.rand`), so the kernel and the torch reference (same contract, torch's generator seeded with `seed`) draw
different tokens for one seed; the tests compare their distributions, and their log-probs and greedy tokens exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import use_triton

BLOCK_V = 2048  # logits a program reads per iteration of its row


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
def _sample_kernel(logits_ptr, temperature_ptr, seed_ptr, tokens_ptr, logprobs_ptr, V: tl.constexpr, stride,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(temperature_ptr + row)
    greedy = t <= 0
    inv_t = 1.0 / tl.where(greedy, 1.0, t)
    seed = tl.load(seed_ptr)
    lanes = tl.arange(0, BLOCK)
    base = logits_ptr + row.to(tl.int64) * stride
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: online softmax over its columns
    run_sum = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: best noisy score, its column and scaled logit
    best_col = tl.full([BLOCK], -1, tl.int32)  # -1: no column yet (lanes past V)
    best_scaled = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + lanes
        inside = cols < V
        x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32) * inv_t
        new_max = tl.maximum(run_max, x)
        # exp(-inf - -inf) is nan: lanes still at -inf add nothing
        run_sum = tl.where(new_max == float("-inf"), 0.0,
                           run_sum * tl.exp(run_max - new_max) + tl.exp(x - new_max))
        run_max = new_max
        u = tl.rand(seed, row.to(tl.int64) * V + cols)
        noisy = tl.where(greedy, x, x - tl.log(-tl.log(u)))
        better = inside & (noisy > best)  # strictly: a lane keeps its first column on a tie
        best = tl.where(better, noisy, best)
        best_col = tl.where(better, cols, best_col)
        best_scaled = tl.where(better, x, best_scaled)
    top = tl.max(best, axis=0)
    col = tl.min(tl.where(best == top, best_col, V), axis=0)  # the first column among the lanes at the top
    picked = tl.max(tl.where(best_col == col, best_scaled, float("-inf")), axis=0)
    m = tl.max(run_max, axis=0)
    lse = m + tl.log(tl.sum(tl.where(run_max == float("-inf"), 0.0, run_sum * tl.exp(run_max - m)), axis=0))
    tl.store(tokens_ptr + row, col.to(tl.int64))
    tl.store(logprobs_ptr + row, picked - lse)


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
        _sample_kernel[(B,)](logits, temperature.float().contiguous(), seed, tokens, logprobs, V, logits.stride(0),
                             BLOCK=BLOCK_V, num_warps=8)
    return tokens, logprobs
