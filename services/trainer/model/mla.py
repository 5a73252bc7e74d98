"""Multi-head Latent Attention (DeepSeek-V2 §2.1, DeepSeek-V3) over packed sequences (`model.attention: mla`).

Keys and values come from a low-rank latent: x -> kv_a_proj_with_mqa -> [latent (kv_lora_rank) | k_rope
(qk_rope_head_dim)]; latent -> RMSNorm -> kv_b_proj -> per head [k_nope | v]. The RoPE part of the key is one head that
every query head shares ("decoupled RoPE": a position-dependent rotation cannot pass through the latent, or kv_b_proj
could not be absorbed into the query at inference). Queries: one q_proj, or (q_lora_rank > 0) q_a_proj -> RMSNorm ->
q_b_proj, per head [q_nope | q_rope]. A head's score is q_nope·k_nope + q_rope·k_rope, scaled by 1/sqrt(nope + rope).

Training expands the latent to per-head keys and values and runs the cores GQA runs (attention.py: varlen flash attention
on CUDA, masked SDPA elsewhere; the context-parallel ring; the rollout's prefill): `qkv` gives q, k [T, H, nope + rope]
and v [T, H, v_head_dim]. The rollout KV cache holds the latent instead (MLA's inference-time saving): `query_and_latent`
gives what it stores, `attend_latent` decodes from it.

Parameter names are transformers' DeepseekV3Attention's, so checkpoints map one to one (services/checkpointer/hf.py).
RoPE rotates pairs (i, i + rope/2) as everywhere in this model; DeepSeek's checkpoints rotate interleaved pairs, and the
HF import permutes those weights' rows to match.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels._triton import use_triton
from kernels.decode_latent_attention import bmm_fp32, decode_latent_attention
from kernels.head_norm_rope import head_norm_rope as fused_head_norm_rope, supports_head_dim
from kernels.head_norm_rope import head_norm_rope_reference as head_norm_rope
from services.common.config import ModelConfig
from services.trainer.model.attention import PackedAttention, compiled_head_norm_rope, packed_causal_attention
from services.trainer.model.fp8_linear import FP8Linear
from services.trainer.model.precision import to_compute_dtype
from services.trainer.model.rope import query_scales, rotary


def latent_norm(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm` of a latent, its fp32 scale cast to the latent's dtype (bf16 under autocast): rms_norm runs its fused
    kernel only for one dtype (head_norm_rope_reference says why that matters)."""
    return F.rms_norm(x, norm.normalized_shape, norm.weight.to(x.dtype), norm.eps)


def _scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x if scale == 1.0 else x * scale


class MLAttention(PackedAttention):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.kv_lora_rank = cfg.num_heads, cfg.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        h, heads, qk = cfg.hidden_size, cfg.num_heads, cfg.qk_head_dim
        # nn.Linear layers (bias-free) whose matmuls run in FP8 on CUDA with `model.fp8` (fp8_linear.py).
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if cfg.q_lora_rank:
            self.q_a_proj = FP8Linear(h, cfg.q_lora_rank, fp8=cfg.fp8)
            self.q_a_layernorm = nn.RMSNorm(cfg.q_lora_rank, eps=cfg.norm_eps)
            self.q_b_proj = FP8Linear(cfg.q_lora_rank, heads * qk, fp8=cfg.fp8)
        else:
            self.q_proj = FP8Linear(h, heads * qk, fp8=cfg.fp8)
        self.kv_a_proj_with_mqa = FP8Linear(h, self.kv_lora_rank + self.rope_dim, fp8=cfg.fp8)
        self.kv_a_layernorm = nn.RMSNorm(self.kv_lora_rank, eps=cfg.norm_eps)
        self.kv_b_proj = FP8Linear(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), fp8=cfg.fp8)
        self.o_proj = FP8Linear(heads * self.v_dim, h, fp8=cfg.fp8)
        self.register_buffer("inv_freq", rotary(self.rope_dim, cfg), persistent=False)
        # YaRN's corrections of the scores (rope.py), folded into q so that every core runs unchanged. 1: none.
        self.nope_scale, self.rope_scale = query_scales(cfg)
        self.norm_eps = cfg.norm_eps
        # RoPE where Triton does not run (CPU) or the rope dim is no power of two, as in attention.py.
        self.head_rope = compiled_head_norm_rope() if cfg.compile else head_norm_rope
        # The core over q, k, v; context parallelism swaps in one with the same signature that exchanges K/V.
        self.core = packed_causal_attention

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(x)
        return self.q_b_proj(latent_norm(self.q_a_layernorm, self.q_a_proj(x)))

    def _rope(self, q_rope: torch.Tensor, k_rope: torch.Tensor, position_ids: torch.Tensor):
        fused = use_triton(q_rope) and supports_head_dim(self.rope_dim)
        rope = fused_head_norm_rope if fused else self.head_rope
        return rope(q_rope, k_rope, None, None, self.norm_eps, position_ids, self.inv_freq)

    def query_and_latent(self, x: torch.Tensor, position_ids: torch.Tensor):
        """x: [T, hidden] -> q [T, H, nope + rope] (rotated, YaRN-scaled), the normalised latent [T, kv_lora_rank] and
        the rotated RoPE key all heads share [T, rope]: what a latent KV cache holds per token."""
        T = x.shape[0]
        x = to_compute_dtype(x)  # once for the projections that read it (precision.py)
        # Head counts are read from the projections so that a tensor-parallel shard (fewer local heads) runs unchanged.
        q_nope, q_rope = self._queries(x).view(T, -1, self.nope_dim + self.rope_dim).split(
            [self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_rope, k_rope = self._rope(q_rope, k_rope.view(T, 1, self.rope_dim), position_ids)
        q = torch.cat((_scaled(q_nope, self.nope_scale), _scaled(q_rope, self.rope_scale)), dim=-1)
        return q, latent_norm(self.kv_a_layernorm, latent), k_rope[:, 0]

    def expand(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys [T, H, nope + rope] and values [T, H, v_head_dim] from the latent and the shared RoPE key."""
        kv = self.kv_b_proj(latent).view(latent.shape[0], -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        return torch.cat((k_nope, k_rope[:, None].expand(-1, k_nope.shape[1], -1)), dim=-1), v

    def qkv(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> q, k [T, H, nope + rope] (rotated, YaRN-scaled q) and v [T, H, v_head_dim]."""
        q, latent, k_rope = self.query_and_latent(x, position_ids)
        return (q, *self.expand(latent, k_rope))

    def attend_latent(self, q: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor, slot: torch.Tensor,
                      pos: torch.Tensor, span: int) -> torch.Tensor:
        """Attention of queries q [B, H, nope + rope] to the latents [S, L, r] and RoPE keys [S, L, rope] cached in
        slot slot[b] at positions 0 .. pos[b] (`span` > every pos: the decode step's bucket), without expanding per-head
        keys and values: kv_b_proj's key half is absorbed into the queries and its value half applied after the
        weighted sum (DeepSeek-V2 §2.1.2), the attention itself kernels/decode_latent_attention.py's (the caches read
        in place on CUDA). -> [B, H, v_head_dim].

        The same scores as the packed core (1/sqrt(nope + rope), YaRN already in q) and its precision: products of
        operands in the cache's dtype accumulated in fp32, scores and softmax in fp32, the probabilities rounded to the
        cache's dtype before they weight the latents (as FlashAttention rounds P before P·V), their weighted sum rounded
        to the cache's dtype before kv_b_proj's value half applies. A decode step's cost is reading the cache once; an
        fp32 copy of it (or of kv_b_proj) at every step would multiply that."""
        w_k, w_v = self.kv_b_proj.weight.view(-1, self.nope_dim + self.v_dim, self.kv_lora_rank).split(
            [self.nope_dim, self.v_dim], dim=1)  # [H, nope, r], [H, v, r]
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        dtype = latent_cache.dtype
        q_latent = bmm_fp32(q_nope.transpose(0, 1).to(w_k.dtype), w_k).transpose(0, 1)  # [B, H, r]
        out_latent = decode_latent_attention(q_latent.to(dtype), q_rope.to(dtype), latent_cache, rope_cache, slot, pos,
                                             span, (self.nope_dim + self.rope_dim) ** -0.5)  # [B, H, r]
        out = bmm_fp32(out_latent.transpose(0, 1).to(w_v.dtype), w_v.transpose(1, 2))  # [H, B, v]
        return out.transpose(0, 1).to(q.dtype)
