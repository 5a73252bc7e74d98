"""The output layer and the cross-entropy in one op, over chunks of tokens: [T, V] logits never exist at once.

    linear_cross_entropy_sum(h [T, H], weight [V, H], labels [T]) -> Σ_t -log softmax(h_t Wᵀ)[labels_t]   (fp32 scalar)

Tokens labelled IGNORE_INDEX (-100) contribute nothing. The tokens are taken `chunk_size` rows at a time: the chunk's
logits [chunk, V] are computed in the compute dtype (the autocast dtype under autocast, as the unfused output layer
does), reduced in fp32 to each row's loss, and overwritten in place by their gradient softmax - onehot. That block
goes straight into grad_h[chunk] = g W and grad_W += gᵀ h_chunk, then is dropped, so forward returns with both
gradients already computed and backward only scales them by the incoming scalar (grad_W, summed in fp32, is rounded
to the weight's dtype in that same pass). Alive at the peak: one [chunk, V] block, grad_W (fp32) and grad_h — instead of the unfused path's [T, V] logits,
their fp32 copy and its saved fp32 log-softmax. No logits are recomputed: three GEMMs, as unfused.

Computing gradients in forward assumes a backward follows (training); with grad disabled, or neither h nor weight
requiring grad, only the loss is computed. One backward per forward: the gradients are handed over, not kept.

With the vocabulary split over a process group (tensor parallelism: `vocab_group`, this rank's rows of W starting at
vocabulary id `vocab_start`), a row's loss needs the whole row: the row step then reads the block once for its
slice's statistics (max, Σexp relative to it, the label's logit where the label falls in the slice), all-gathers
those three numbers per row over the group — one collective per chunk, [3, chunk] fp32 per rank — combines them into
the row's log-sum-exp and target logit, and writes the slice's gradient exp(x - lse) - onehot in a second pass. Every
rank returns the same loss; grad_h is this rank's partial sum (its vocabulary slice's share), which the caller's
all-gather of h completes in its backward (reduce-scatter) as for the unfused vocab-parallel loss.

One chunk loop, two implementations of its row step (logits block -> row losses, block overwritten by the gradient):
- `linear_cross_entropy_sum_reference`: torch ops in fp32 (a logsumexp, then exp/scatter/mul passes over an fp32
  copy of the block) — what the chunking alone buys is the memory;
- `linear_cross_entropy_sum`: on CUDA, a Triton program per row that reads the row twice (online max/Σexp, then the
  gradient) and writes it once, in the block's own dtype, with no fp32 copy.
"""

from __future__ import annotations

from typing import Callable

from functools import partial

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kernels._triton import autotune, use_triton

IGNORE_INDEX = -100  # as services/trainer/model/loss.py

# Rows of one chunk: the largest multiple of 256 whose logits block stays within this many bytes (at least 256 rows).
# 1 GiB is 3328 rows at V=151936 in bf16: five chunks for a 16k-token micro-batch, each GEMM still large.
CHUNK_BYTES = 1 << 30

RowStep = Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]

# torch 2.13 renames the tensor-in/tensor-out all-gather; 2.11 has only the old name (same signature).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def default_chunk_size(vocab: int, dtype: torch.dtype) -> int:
    rows = CHUNK_BYTES // max(vocab * torch.tensor([], dtype=dtype).element_size(), 1)
    return max(256, rows // 256 * 256)


# ---------------------------------------------------------------- row step: torch


def ce_rows_reference(logits: torch.Tensor, labels: torch.Tensor, write_grad: bool) -> torch.Tensor:
    """Row losses [C] (fp32) of a logits block [C, V]; with `write_grad`, the block becomes softmax - onehot (0 for
    ignored rows), in its own dtype."""
    x = logits.float()  # the block itself when it is already fp32
    valid = labels != IGNORE_INDEX
    idx = torch.where(valid, labels, 0)[:, None]
    lse = torch.logsumexp(x, dim=1)
    loss = (lse - x.gather(1, idx).squeeze(1)) * valid
    if write_grad:
        x.sub_(lse[:, None]).exp_()
        x.scatter_add_(1, idx, torch.full_like(idx, -1, dtype=x.dtype))
        x.mul_(valid[:, None])
        logits.copy_(x)
    return loss


# ---------------------------------------------------------------- row step: Triton

_ROW_CONFIGS = [
    triton.Config({"BLOCK_V": 4096}, num_warps=8),
    triton.Config({"BLOCK_V": 2048}, num_warps=4),
    triton.Config({"BLOCK_V": 8192}, num_warps=8),
    triton.Config({"BLOCK_V": 8192}, num_warps=16),
    triton.Config({"BLOCK_V": 16384}, num_warps=16),
]


@triton.jit
def _row_max_sumexp(row_ptr, V: tl.constexpr, BLOCK_V: tl.constexpr):
    """One pass over a row of V logits: its max m and Σexp(x - m), rescaled online block by block."""
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    return m, s


# restore_value: the kernel overwrites the block, so each config tried must start from the same logits.
@autotune(_ROW_CONFIGS, key=["V", "WRITE_GRAD"], restore_value=["logits_ptr"])
@triton.jit
def _ce_rows_kernel(logits_ptr, labels_ptr, loss_ptr, V: tl.constexpr, WRITE_GRAD: tl.constexpr,
                    IGNORE: tl.constexpr, BLOCK_V: tl.constexpr):
    # One program per row. Pass 1: running max m and Σexp(x - m) over the row; lse = m + log Σ. Pass 2: the row is
    # overwritten by exp(x - lse) - [col == label], zero for an ignored row. V is constexpr: a static trip count.
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * V
    label = tl.load(labels_ptr + row).to(tl.int64)
    valid = label != IGNORE
    m, s = _row_max_sumexp(row_ptr, V, BLOCK_V)
    lse = m + tl.log(s)
    target = tl.load(row_ptr + tl.where(valid, label, 0)).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - target, 0.0))
    if WRITE_GRAD:
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < V
            x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)
            g = tl.where(valid, g, 0.0)
            tl.store(row_ptr + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)


def ce_rows_triton(logits: torch.Tensor, labels: torch.Tensor, write_grad: bool) -> torch.Tensor:
    """`ce_rows_reference` as one Triton program per row (contiguous block)."""
    C, V = logits.shape
    loss = torch.empty(C, dtype=torch.float32, device=logits.device)
    if C > 0:
        _ce_rows_kernel[(C,)](logits, labels.contiguous(), loss, V, write_grad, IGNORE_INDEX)
    return loss


# ---------------------------------------------------------------- row step over a vocabulary split across ranks


def ce_slice_stats_reference(logits: torch.Tensor, local_labels: torch.Tensor) -> torch.Tensor:
    """[3, C] fp32 per row of a block [C, V] holding one vocabulary slice: the row's max m, Σexp(x - m), and the
    label's logit where the label falls in the slice (`local_labels` >= 0; -1 elsewhere: 0)."""
    x = logits.float()
    m = x.max(dim=1).values
    here = local_labels >= 0
    target = x.gather(1, local_labels.clamp(min=0)[:, None]).squeeze(1) * here
    return torch.stack([m, (x - m[:, None]).exp().sum(dim=1), target])


def ce_slice_grad_reference(logits: torch.Tensor, local_labels: torch.Tensor, lse: torch.Tensor) -> None:
    """In place: the block becomes exp(x - lse) - [col == label] in its own dtype (lse +inf: a row of zeros)."""
    x = logits.float().sub_(lse[:, None]).exp_()
    here = local_labels >= 0
    idx = local_labels.clamp(min=0)[:, None]
    x.scatter_add_(1, idx, -here.to(x.dtype)[:, None])
    logits.copy_(x)


@autotune(_ROW_CONFIGS, key=["V"])
@triton.jit
def _ce_slice_stats_kernel(logits_ptr, local_labels_ptr, stats_ptr, C, V: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * V
    m, s = _row_max_sumexp(row_ptr, V, BLOCK_V)
    label = tl.load(local_labels_ptr + row).to(tl.int64)
    target = tl.load(row_ptr + tl.maximum(label, 0)).to(tl.float32)
    tl.store(stats_ptr + row, m)
    tl.store(stats_ptr + C + row, s)
    tl.store(stats_ptr + 2 * C + row, tl.where(label >= 0, target, 0.0))


# restore_value: the kernel overwrites the block, so each config tried must start from the same logits.
@autotune(_ROW_CONFIGS, key=["V"], restore_value=["logits_ptr"])
@triton.jit
def _ce_slice_grad_kernel(logits_ptr, local_labels_ptr, lse_ptr, V: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * V
    label = tl.load(local_labels_ptr + row).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)
        tl.store(row_ptr + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)


def ce_slice_stats_triton(logits: torch.Tensor, local_labels: torch.Tensor) -> torch.Tensor:
    """`ce_slice_stats_reference` as one Triton program per row (contiguous block)."""
    C, V = logits.shape
    stats = torch.empty(3, C, dtype=torch.float32, device=logits.device)
    if C > 0:
        _ce_slice_stats_kernel[(C,)](logits, local_labels.contiguous(), stats, C, V)
    return stats


def ce_slice_grad_triton(logits: torch.Tensor, local_labels: torch.Tensor, lse: torch.Tensor) -> None:
    """`ce_slice_grad_reference` as one Triton program per row (contiguous block)."""
    C, V = logits.shape
    if C > 0:
        _ce_slice_grad_kernel[(C,)](logits, local_labels.contiguous(), lse.contiguous(), V)


def ce_rows_split_vocab(stats_fn, grad_fn, group: dist.ProcessGroup, vocab_start: int, logits: torch.Tensor,
                        labels: torch.Tensor, write_grad: bool) -> torch.Tensor:
    """The row step (`RowStep`, once `partial` binds the rest) for a block holding the vocabulary slice
    [vocab_start, vocab_start + V) of `group`'s split: row losses [C] over the whole vocabulary, equal on every rank."""
    C, V = logits.shape
    valid = labels != IGNORE_INDEX
    local = labels - vocab_start
    local = torch.where(valid & (local >= 0) & (local < V), local, -1)
    stats = stats_fn(logits, local)
    gathered = stats.new_empty(dist.get_world_size(group) * 3, C)
    _all_gather_single(gathered, stats, group=group)
    m, s, target = gathered.view(-1, 3, C).unbind(1)  # [ranks, C] each
    row_max = m.max(dim=0).values
    lse = row_max + (s * (m - row_max).exp()).sum(dim=0).log()
    if write_grad:
        grad_fn(logits, local, lse.masked_fill(~valid, float("inf")))  # an ignored row's gradient is 0
    return (lse - target.sum(dim=0)) * valid


# ---------------------------------------------------------------- the chunk loop


def _chunked_loss_and_grads(h, weight, labels, dtype, chunk_size, rows: RowStep, grad_h_needed, grad_w_needed):
    """(Σ loss fp32, grad_h or None, grad_W or None) for a unit incoming gradient, one [chunk, V] block at a time."""
    w = weight.to(dtype)  # the compute-dtype copy lives only for this forward: backward needs no weights
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    write_grad = grad_h_needed or grad_w_needed
    grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device) if grad_h_needed else None
    # Accumulated over chunks in fp32 by the GEMM itself (its epilogue adds into grad_w: no [V, H] product in the
    # compute dtype, no separate add pass, no rounding per chunk), rounded once at the end. The CPU build has no
    # bf16-in/fp32-out GEMM: there the product is added in a separate pass.
    fp32_out = dtype != torch.float32 and h.is_cuda
    grad_w = None
    if grad_w_needed and not fp32_out:
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
    for start in range(0, h.shape[0], chunk_size):
        end = min(start + chunk_size, h.shape[0])
        h_chunk = h[start:end].to(dtype)
        logits = h_chunk @ w.T
        loss += rows(logits, labels[start:end], write_grad).sum()
        if grad_h_needed:
            if grad_h.dtype == dtype:
                torch.mm(logits, w, out=grad_h[start:end])
            else:
                grad_h[start:end] = logits @ w
        if grad_w_needed:
            if fp32_out and grad_w is None:
                grad_w = torch.mm(logits.T, h_chunk, out_dtype=torch.float32)
            elif fp32_out:
                torch.addmm(grad_w, logits.T, h_chunk, out_dtype=torch.float32, out=grad_w)
            elif dtype == torch.float32:
                grad_w.addmm_(logits.T, h_chunk)
            else:
                grad_w += logits.T @ h_chunk
        del logits
    if grad_w_needed and grad_w is None:  # no rows at all
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
    return loss, grad_h, grad_w  # grad_w stays fp32: backward scales and rounds it in one pass


@triton.jit
def _scale_to_kernel(src_ptr, scale_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + offs, mask=mask) * tl.load(scale_ptr)
    tl.store(dst_ptr + offs, x.to(dst_ptr.dtype.element_ty), mask=mask)


def scale_to(src: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`src` (contiguous fp32) times the 0-d device tensor `scale`, rounded once to `dtype` (in place when fp32).
    torch's `mul` with a 0-d CUDA operand takes its broadcasting, unvectorized path: 1.23 ms for the 151936 x 2048
    output-layer gradient on an H100, at about half the memory bandwidth; here one vectorized pass."""
    out = src if dtype == torch.float32 else torch.empty_like(src, dtype=dtype)
    scale = scale.to(torch.float32)
    if not src.is_cuda:  # not in Triton's CPU interpreter either: it truncates fp32 -> bf16 stores instead of rounding
        return torch.mul(src, scale, out=out)
    n = src.numel()
    if n:
        _scale_to_kernel[(triton.cdiv(n, 4096),)](src, scale, out, n, BLOCK=4096, num_warps=8)
    return out


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, dtype, chunk_size, rows: RowStep, grad_h_needed, grad_w_needed):
        ctx.weight_dtype = weight.dtype
        with torch.autocast(h.device.type, enabled=False):  # every dtype in the loop is explicit
            loss, *ctx.grads = _chunked_loss_and_grads(h, weight, labels, dtype, chunk_size, rows, grad_h_needed,
                                                       grad_w_needed)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy_sum computes its gradients in forward and hands them to the "
                               "first backward; run forward again for a second backward")
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        if grad_h is not None:
            grad_h.mul_(grad_loss.to(grad_h.dtype))
        if grad_w is not None:  # fp32 sum: scaled and rounded to the weight's dtype in one pass (in place if fp32)
            grad_w = scale_to(grad_w, grad_loss, ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None, None, None


def _compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(h.device.type):
        return torch.get_autocast_dtype(h.device.type)
    if h.dtype != weight.dtype:
        raise ValueError(f"linear_cross_entropy_sum: h is {h.dtype} but weight is {weight.dtype}; cast one, or run "
                         f"under torch.autocast to compute in its dtype")
    return h.dtype


def _linear_cross_entropy(h, weight, labels, chunk_size, rows: RowStep) -> torch.Tensor:
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1] or labels.shape != (h.shape[0],):
        raise ValueError(f"linear_cross_entropy_sum wants h [T, H], weight [V, H], labels [T]; got "
                         f"{tuple(h.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}")
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"linear_cross_entropy_sum: chunk_size must be positive, got {chunk_size}")
    dtype = _compute_dtype(h, weight)
    chunk = chunk_size or default_chunk_size(weight.shape[0], dtype)
    grad = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(h, weight, labels, dtype, chunk, rows, grad and h.requires_grad,
                                     grad and weight.requires_grad)


def _split(stats_fn, grad_fn, vocab_group: dist.ProcessGroup | None, vocab_start: int) -> RowStep | None:
    if vocab_group is None or dist.get_world_size(vocab_group) == 1:
        return None
    return partial(ce_rows_split_vocab, stats_fn, grad_fn, vocab_group, vocab_start)


def linear_cross_entropy_sum_reference(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                       chunk_size: int | None = None, vocab_group: dist.ProcessGroup | None = None,
                                       vocab_start: int = 0) -> torch.Tensor:
    """Same contract as `linear_cross_entropy_sum`, its row step in torch ops."""
    rows = _split(ce_slice_stats_reference, ce_slice_grad_reference, vocab_group, vocab_start) or ce_rows_reference
    return _linear_cross_entropy(h, weight, labels, chunk_size, rows)


def linear_cross_entropy_sum(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             chunk_size: int | None = None, vocab_group: dist.ProcessGroup | None = None,
                             vocab_start: int = 0) -> torch.Tensor:
    """Σ token cross-entropy of `h @ weight.T` against `labels`, chunked (see the module docstring). Triton row step on
    CUDA, the torch reference on CPU. `chunk_size`: rows per chunk (default: `default_chunk_size`). `vocab_group`: the
    group the vocabulary is split over, `weight` holding ids [vocab_start, vocab_start + len(weight))."""
    if use_triton(h):
        rows = _split(ce_slice_stats_triton, ce_slice_grad_triton, vocab_group, vocab_start) or ce_rows_triton
    else:
        rows = _split(ce_slice_stats_reference, ce_slice_grad_reference, vocab_group, vocab_start) or ce_rows_reference
    return _linear_cross_entropy(h, weight, labels, chunk_size, rows)
