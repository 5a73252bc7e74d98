"""GQA self-attention over packed sequences: tokens attend causally within their own document only.

The packed micro-batch is one flat [T, hidden] tensor with `cu_seqlens` marking document boundaries. On CUDA the core is
`torch.nn.attention.varlen.varlen_attn` (flash attention on variable-length segments, no T×T mask); elsewhere, SDPA with an
explicit block-diagonal causal mask, which is exact and fine for the small shapes tests use. The core is shared with
Multi-head Latent Attention (mla.py), whose values are narrower than its queries and keys.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels._triton import use_triton
from kernels.head_norm_rope import head_norm_rope as fused_head_norm_rope, supports_head_dim
from kernels.head_norm_rope import head_norm_rope_reference as head_norm_rope
from services.common.config import ModelConfig
from services.trainer.model.flash_varlen import causal_gqa
from services.trainer.model.fp8_linear import FP8Linear
from services.trainer.model.precision import to_compute_dtype
from services.trainer.model.rope import query_scales, rotary


@functools.cache  # asked on first CUDA use: importing varlen pulls in torch._dynamo (seconds per process)
def _varlen_supports_gqa() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def longest_document(cu_seqlens: torch.Tensor) -> int:
    """The longest segment of `cu_seqlens`, as the attention kernels take it: a host number. Read it from host
    `cu_seqlens` where the batch still has them (on a device tensor this waits for the device)."""
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Segment index of every token: [T] int64. No host sync: a boundary at or past `total` (an empty trailing
    segment) adds 0 rather than being filtered out with a mask, whose size the host would have to wait for."""
    marks = torch.zeros(total, dtype=torch.int64, device=cu_seqlens.device)
    starts = cu_seqlens[1:-1].to(torch.int64)
    marks.index_add_(0, starts.clamp(max=total - 1), (starts < total).to(torch.int64))
    return marks.cumsum(0)


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int | None = None, cu_seqlens_k: torch.Tensor | None = None,
                            max_seqlen_k: int | None = None) -> torch.Tensor:
    """q: [Tq, Hq, d], k: [Tk, Hkv, d], v: [Tk, Hkv, dv] -> [Tq, Hq, dv]; causal inside each segment of `cu_seqlens`,
    scores scaled by 1/sqrt(d). Without `cu_seqlens_k` the keys are the queries' tokens. With it (and `max_seqlen_k`, a
    host number) segment i's keys are segment i of `cu_seqlens_k`, aligned at the bottom right: n queries against m
    keys are the last n of the m positions (query j sees keys 0 .. m - n + j), i.e. queries continuing a cached prefix
    (the rollout's chunked and prefix-shared prefill)."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        from torch.nn.attention.varlen import varlen_attn

        cu = cu_seqlens.to(torch.int32)
        max_len = max_seqlen or longest_document(cu)
        if cu_seqlens_k is not None:
            dv = v.shape[-1]
            q, k, v = _equal_head_dims(q, k, v)
            cu_k = cu_seqlens_k.to(torch.int32)
            return causal_gqa(q, k, v, cu, max_len, cu_k, max_seqlen_k or longest_document(cu_k))[..., :dv]
        if v.shape[-1] != q.shape[-1]:
            dv = v.shape[-1]
            q, k, v = _equal_head_dims(q, k, v)
            return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0))[..., :dv]
        if k.shape[1] != q.shape[1]:
            if _varlen_supports_gqa():
                return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0), enable_gqa=True)
            return causal_gqa(q, k, v, cu, max_len)  # torch 2.11's varlen_attn has no enable_gqa: the kernels direct
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0))
    return _masked_attention(q, k, v, cu_seqlens, cu_seqlens_k)


def _masked_attention(q, k, v, cu_q: torch.Tensor, cu_k: torch.Tensor | None) -> torch.Tensor:
    """SDPA under the visibility mask `packed_causal_attention` describes (exact; [Tq, Tk] booleans, for CPU shapes)."""
    doc_q = document_ids(cu_q, q.shape[0])
    # each query's position among its segment's keys: its own, shifted by the keys its segment has before its queries
    pos_q = torch.arange(q.shape[0], device=q.device) - cu_q.to(torch.int64)[doc_q]
    if cu_k is None:
        doc_k, pos_k = doc_q, pos_q
    else:
        doc_k = document_ids(cu_k, k.shape[0])
        pos_k = torch.arange(k.shape[0], device=k.device) - cu_k.to(torch.int64)[doc_k]
        pos_q = pos_q + (cu_k.diff() - cu_q.diff()).to(torch.int64)[doc_q]
    mask = (doc_q[:, None] == doc_k[None, :]) & (pos_k[None, :] <= pos_q[:, None])
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(0, 1)


def _equal_head_dims(q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v brought to one head dim for FlashAttention-2's kernels (under varlen_attn), which take one for all
    three (MLA's values are narrower or wider than its queries and keys). Zero columns appended to the narrower side
    change no score and no kept output column: narrower values (DeepSeek-V3: 128 against 192) get zero columns, whose
    zero outputs the caller cuts off; narrower queries and keys get them too, with q scaled so that the kernel's
    1/sqrt(padded dim) is still 1/sqrt(d) of the scores."""
    d, dv = q.shape[-1], v.shape[-1]
    if dv < d:
        return q, k, F.pad(v, (0, d - dv))
    if dv > d:
        return F.pad(q * math.sqrt(dv / d), (0, dv - d)), F.pad(k, (0, dv - d)), v
    return q, k, v


@functools.cache
def compiled_head_norm_rope():
    """The QK-norm + RoPE reference through torch.compile, for `model.compile` off CUDA (on CUDA the Triton kernels
    of kernels/head_norm_rope.py run, 1.7-1.9x faster than this). Built once per process (dynamo re-traces only for new
    shapes and dtypes: it guards on them, and the second distinct token count compiles a shape-generic version)."""
    return torch.compile(head_norm_rope)


class PackedAttention(nn.Module):
    """What GQA and MLA share: `qkv` (each its own) projects the packed tokens to q, k, v; `core` attends inside each
    document (context parallelism swaps in a core of the same signature); `o_proj` projects the heads back."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int | None = None) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv(x, position_ids)
        out = self.core(q, k, v, cu_seqlens, max_seqlen)
        return self.o_proj(out.reshape(T, -1))


class Attention(PackedAttention):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.kv_channels
        # nn.Linear layers (names, shapes, state_dict as nn.Linear's) whose matmuls run in FP8 on CUDA with `model.fp8`.
        # Qwen2's q/k/v biases with `model.qkv_bias`.
        self.q_proj = FP8Linear(cfg.hidden_size, self.num_heads * self.head_dim, fp8=cfg.fp8, bias=cfg.qkv_bias)
        self.k_proj = FP8Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, fp8=cfg.fp8, bias=cfg.qkv_bias)
        self.v_proj = FP8Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, fp8=cfg.fp8, bias=cfg.qkv_bias)
        self.o_proj = FP8Linear(self.num_heads * self.head_dim, cfg.hidden_size, fp8=cfg.fp8)
        # Qwen3's QK-norm: RMSNorm of every query and key head over head_dim (one scale shared by all heads), before RoPE.
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.norm_eps = cfg.norm_eps
        self.register_buffer("inv_freq", rotary(self.head_dim, cfg), persistent=False)
        # YaRN's corrections of the scores (rope.py), on q alone; every dim of a GQA head is rotated. 1: none.
        self.q_scale = query_scales(cfg)[1]
        # QK-norm + RoPE where Triton does not run (CPU) or the head dim is no power of two; elsewhere `qkv` takes
        # the fused kernels, `model.compile` or not.
        self.head_norm_rope = compiled_head_norm_rope() if cfg.compile else head_norm_rope
        # The core over rotated q, k, v; context parallelism swaps in one with the same signature that exchanges K/V.
        self.core = packed_causal_attention

    def qkv(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> q [T, Hq, d], k and v [T, Hkv, d]: projected, QK-normed (if on) and rotated."""
        T = x.shape[0]
        x = to_compute_dtype(x)  # once for the three projections (services/trainer/model/precision.py)
        # Head counts are read from the projections so that a tensor-parallel shard (fewer local heads) runs unchanged.
        q = self.q_proj(x).view(T, -1, self.head_dim)
        k = self.k_proj(x).view(T, -1, self.head_dim)
        v = self.v_proj(x).view(T, -1, self.head_dim)
        scales = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
        fused = use_triton(q) and supports_head_dim(self.head_dim)
        norm_rope = fused_head_norm_rope if fused else self.head_norm_rope
        q, k = norm_rope(q, k, *scales, self.norm_eps, position_ids, self.inv_freq)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return q, k, v

