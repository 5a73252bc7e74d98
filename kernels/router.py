"""Fused router: scores, biased top-k selection, combine weights and load-balancing statistics in one pass.

    router(logits [T, E], k, score_function, expert_bias, normalise, scaling_factor) -> Routing

Semantics (fp32 throughout, whatever the logits' dtype):
- scores = softmax(logits) over experts, or sigmoid(logits) element-wise;
- selection = top-k of scores + expert_bias. The bias is the aux-loss-free balancing knob: it changes which experts
  are chosen, never the weights;
- weights = scores at the chosen experts, divided by their sum when `normalise`, times `scaling_factor`;
- statistics for the aux loss: tokens_per_expert (how many tokens chose each expert) and mean_probs (the mean over
  tokens of the per-token probability distribution over experts: the softmax itself, or the sigmoid scores divided by
  their row sum, so that both sum to 1 per token).
The chosen experts come out in descending order of selection score; on an exact tie the kernel takes the lower
expert index first (torch.topk, in the reference, leaves the order of ties unspecified). Group-limited routing stays
in torch (it masks logits before this function).

One program owns BLOCK_T whole rows (E fits a block: E <= 1024 here), so softmax, top-k by k rounds of argmax and the
per-program column sums of the statistics need no communication; the statistics' partial sums per program are
reduced by torch afterwards, in a fixed order, so the result is deterministic (no float atomics).

Backward is one kernel too (`_router_bwd_kernel`): from the saved logits and chosen indices it recomputes the scores
per row and writes d logits = (d scores through the weights' gather + normalisation, and through mean_probs) pushed
back through the softmax or sigmoid. In torch ops, the same backward is a dozen small [T, E] kernels (1.08 ms forward +
backward at 16k tokens, E=128, on an H100; bench/RESULTS.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels._triton import next_power_of_2, use_triton

SCORE_FUNCTIONS = ("softmax", "sigmoid")
_MAX_EXPERTS = 1024
_EPS = 1e-20  # guards the normalising division; only a row of all-zero sigmoid scores could need it
TILE_ELEMENTS, NUM_WARPS = 4096, 4  # a program's [BLOCK_T, E_PAD] tile: E=128 -> 32 rows, E=256 -> 16


def _rows_per_program(e_pad: int) -> int:
    return max(1, min(64, TILE_ELEMENTS // e_pad))


class Routing(NamedTuple):
    weights: torch.Tensor  # [T, k] fp32 combine weights
    indices: torch.Tensor  # [T, k] int64 chosen experts, best first
    tokens_per_expert: torch.Tensor  # [E] int32 number of tokens that chose each expert
    mean_probs: torch.Tensor  # [E] fp32 mean over tokens of the per-token expert distribution


def _check(logits: torch.Tensor, k: int, score_function: str, expert_bias: torch.Tensor | None) -> None:
    if logits.dim() != 2:
        raise ValueError(f"router wants logits [T, E], got {tuple(logits.shape)}")
    E = logits.shape[1]
    if not 1 <= k <= E:
        raise ValueError(f"router top-k needs 1 <= k <= num_experts, got k={k} with {E} experts")
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"router score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
    if expert_bias is not None and expert_bias.shape != (E,):
        raise ValueError(f"expert_bias must be [num_experts] = [{E}], got {tuple(expert_bias.shape)}")


def _scores(logits: torch.Tensor, score_function: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, per-token distribution for the aux statistics), both fp32 [T, E]."""
    logits = logits.float()
    if score_function == "softmax":
        probs = torch.softmax(logits, dim=-1)
        return probs, probs
    scores = torch.sigmoid(logits)
    return scores, scores / (scores.sum(-1, keepdim=True) + _EPS)


def _weights(scores: torch.Tensor, indices: torch.Tensor, normalise: bool, scaling_factor: float) -> torch.Tensor:
    weights = scores.gather(1, indices)
    if normalise:
        weights = weights / (weights.sum(-1, keepdim=True) + _EPS)
    return weights * scaling_factor


def router_reference(logits: torch.Tensor, k: int, score_function: str = "softmax",
                     expert_bias: torch.Tensor | None = None, normalise: bool = False,
                     scaling_factor: float = 1.0) -> Routing:
    """Same contract as `router`, in plain (differentiable) torch ops."""
    _check(logits, k, score_function, expert_bias)
    scores, dist = _scores(logits, score_function)
    selection = scores if expert_bias is None else scores + expert_bias.float()
    indices = torch.topk(selection.detach(), k, dim=-1).indices
    weights = _weights(scores, indices, normalise, scaling_factor)
    counts = torch.zeros(logits.shape[1], dtype=torch.int32, device=logits.device)
    counts.scatter_add_(0, indices.reshape(-1), torch.ones_like(indices.reshape(-1), dtype=torch.int32))
    return Routing(weights, indices, counts, dist.mean(0))


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, weights_ptr, indices_ptr, count_partial_ptr, prob_partial_ptr,
                   T, E, scaling_factor, K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                   BLOCK_T: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALISE: tl.constexpr,
                   EPS: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    rmask = rows < T
    cmask = cols < E
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * E + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                other=0.0).to(tl.float32)
    x = tl.where(cmask[None, :], x, float("-inf"))  # padding columns: zero softmax mass, zero sigmoid score
    if SIGMOID:
        scores = tl.where(cmask[None, :], tl.sigmoid(x), 0.0)
        dist = scores / (tl.sum(scores, axis=1)[:, None] + EPS)
    else:
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        scores = e / tl.sum(e, axis=1)[:, None]
        dist = scores
    selection = scores
    if HAS_BIAS:
        selection = selection + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    selection = tl.where(cmask[None, :], selection, float("-inf"))

    slots = tl.arange(0, K_PAD)
    weights = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    chosen_idx = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    chosen = tl.zeros([BLOCK_T, E_PAD], dtype=tl.int32)
    for j in range(K):  # k rounds of argmax (a loop, not unrolled: unrolling k argmaxes multiplies compile time)
        best = tl.argmax(selection, axis=1, tie_break_left=True)  # [BLOCK_T]
        hit = cols[None, :] == best[:, None]
        w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        weights = tl.where(slots[None, :] == j, w[:, None], weights)
        chosen_idx = tl.where(slots[None, :] == j, best[:, None], chosen_idx)
        chosen += hit.to(tl.int32)
        selection = tl.where(hit, float("-inf"), selection)
    if NORMALISE:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + EPS)
    weights = weights * scaling_factor

    out_mask = rmask[:, None] & (slots < K)[None, :]
    out_offs = rows[:, None].to(tl.int64) * K + slots[None, :]
    tl.store(weights_ptr + out_offs, weights, mask=out_mask)
    tl.store(indices_ptr + out_offs, chosen_idx.to(tl.int64), mask=out_mask)
    chosen = tl.where(rmask[:, None], chosen, 0)
    dist = tl.where(rmask[:, None], dist, 0.0)
    tl.store(count_partial_ptr + pid * E + cols, tl.sum(chosen, axis=0), mask=cmask)
    tl.store(prob_partial_ptr + pid * E + cols, tl.sum(dist, axis=0), mask=cmask)


@triton.jit
def _router_bwd_kernel(logits_ptr, indices_ptr, grad_w_ptr, grad_mp_ptr, grad_logits_ptr, T, E, scaling_factor, inv_T,
                       K: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr, SIGMOID: tl.constexpr,
                       NORMALISE: tl.constexpr, HAS_GRAD_WEIGHTS: tl.constexpr, HAS_GRAD_MEAN_PROBS: tl.constexpr,
                       EPS: tl.constexpr):
    """d logits for BLOCK_T rows. With s the scores, S = Σ_chosen s, g_j = d weight_j · scaling_factor:
    d s_i = g_i / (S + eps) - Σ_j g_j s_j / (S + eps)² for chosen i (g_i alone without normalisation), 0 elsewhere;
    plus d mean_probs / T through the per-token distribution (s itself, or s / (Σ s + eps) for sigmoid);
    then d logits = s (d s - Σ d s · s) for softmax, d s · s (1 - s) for sigmoid."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    rmask = rows < T
    cmask = cols < E
    mask = rmask[:, None] & cmask[None, :]
    offs = rows[:, None].to(tl.int64) * E + cols[None, :]
    x = tl.load(logits_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.where(cmask[None, :], x, float("-inf"))
    if SIGMOID:
        s = tl.where(cmask[None, :], tl.sigmoid(x), 0.0)
    else:
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        s = e / tl.sum(e, axis=1)[:, None]
    ds = tl.zeros([BLOCK_T, E_PAD], dtype=tl.float32)
    if HAS_GRAD_WEIGHTS:
        chosen = tl.zeros([BLOCK_T, E_PAD], dtype=tl.int1)
        picked_sum = tl.zeros([BLOCK_T], dtype=tl.float32)  # S
        weighted_sum = tl.zeros([BLOCK_T], dtype=tl.float32)  # Σ g_j s_j
        for j in range(K):
            idx = tl.load(indices_ptr + rows.to(tl.int64) * K + j, mask=rmask, other=-1)
            g = tl.load(grad_w_ptr + rows.to(tl.int64) * K + j, mask=rmask, other=0.0) * scaling_factor
            hit = cols[None, :] == idx[:, None]
            s_j = tl.sum(tl.where(hit, s, 0.0), axis=1)
            picked_sum += s_j
            weighted_sum += g * s_j
            ds = tl.where(hit, g[:, None], ds)
            chosen = chosen | hit
        if NORMALISE:
            denom = picked_sum + EPS
            ds = tl.where(chosen, (ds - (weighted_sum / denom)[:, None]) / denom[:, None], 0.0)
    if HAS_GRAD_MEAN_PROBS:
        gm = tl.load(grad_mp_ptr + cols, mask=cmask, other=0.0)[None, :] * inv_T
        if SIGMOID:
            z = tl.sum(s, axis=1)[:, None] + EPS
            ds += (gm - tl.sum(gm * s, axis=1)[:, None] / z) / z
        else:
            ds += gm
    if SIGMOID:
        dx = ds * s * (1.0 - s)
    else:
        dx = s * (ds - tl.sum(ds * s, axis=1)[:, None])
    tl.store(grad_logits_ptr + offs, dx, mask=mask)


class _RouterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, expert_bias, k, score_function, normalise, scaling_factor):
        T, E = logits.shape
        logits = logits.contiguous()
        device = logits.device
        e_pad = next_power_of_2(E)
        block_t = _rows_per_program(e_pad)
        n_programs = triton.cdiv(T, block_t)
        weights = torch.empty((T, k), dtype=torch.float32, device=device)
        indices = torch.empty((T, k), dtype=torch.int64, device=device)
        count_partial = torch.empty((n_programs, E), dtype=torch.int32, device=device)
        prob_partial = torch.empty((n_programs, E), dtype=torch.float32, device=device)
        if T > 0:
            bias = expert_bias.contiguous() if expert_bias is not None else logits
            _router_kernel[(n_programs,)](
                logits, bias, weights, indices, count_partial, prob_partial, T, E, float(scaling_factor),
                K=k, K_PAD=next_power_of_2(k), E_PAD=e_pad, BLOCK_T=block_t,
                SIGMOID=score_function == "sigmoid", HAS_BIAS=expert_bias is not None, NORMALISE=normalise, EPS=_EPS,
                num_warps=NUM_WARPS)
        tokens_per_expert = count_partial.sum(0, dtype=torch.int32)
        mean_probs = prob_partial.sum(0) / T if T > 0 else torch.full((E,), float("nan"), device=device)
        ctx.save_for_backward(logits, indices)
        ctx.config = (score_function, normalise, scaling_factor)
        ctx.mark_non_differentiable(indices, tokens_per_expert)
        return weights, indices, tokens_per_expert, mean_probs

    @staticmethod
    def backward(ctx, grad_weights, _grad_indices, _grad_counts, grad_mean_probs):
        logits, indices = ctx.saved_tensors
        score_function, normalise, scaling_factor = ctx.config
        if grad_weights is None and grad_mean_probs is None:
            return (None,) * 6
        T, E = logits.shape
        k = indices.shape[1]
        grad_logits = torch.empty((T, E), dtype=torch.float32, device=logits.device)
        if T > 0:
            e_pad = next_power_of_2(E)
            block_t = _rows_per_program(e_pad)
            gw = grad_weights.float().contiguous() if grad_weights is not None else grad_logits
            gm = grad_mean_probs.float().contiguous() if grad_mean_probs is not None else grad_logits
            _router_bwd_kernel[(triton.cdiv(T, block_t),)](
                logits, indices, gw, gm, grad_logits, T, E, float(scaling_factor), 1.0 / T,
                K=k, E_PAD=e_pad, BLOCK_T=block_t, SIGMOID=score_function == "sigmoid", NORMALISE=normalise,
                HAS_GRAD_WEIGHTS=grad_weights is not None, HAS_GRAD_MEAN_PROBS=grad_mean_probs is not None, EPS=_EPS,
                num_warps=NUM_WARPS)
        return grad_logits.to(logits.dtype), None, None, None, None, None


def router(logits: torch.Tensor, k: int, score_function: str = "softmax", expert_bias: torch.Tensor | None = None,
           normalise: bool = False, scaling_factor: float = 1.0) -> Routing:
    """Route each token to k experts (see the module docstring). Triton on CUDA, the torch reference on CPU."""
    _check(logits, k, score_function, expert_bias)
    if not use_triton(logits) or logits.shape[1] > _MAX_EXPERTS:
        return router_reference(logits, k, score_function, expert_bias, normalise, scaling_factor)
    return Routing(*_RouterFunction.apply(logits, expert_bias, k, score_function, normalise, scaling_factor))
