"""A cached forward pass over the trainer's `MoETransformer`: prefill a packed batch of prompts, then decode one token per
sequence per step, reusing the model's own modules and weights (embedding, norms, the attention's `qkv` and o_proj,
RoPE, MLP/MoE, output layer; GQA or MLA alike). Only the attention core differs: prefill uses the model's packed causal attention, decode attends one
query per sequence to that sequence's cached keys.

The cache is slot based: `slots` sequences of at most `max_len` tokens, one slot per running sequence. A slot is reused
as soon as its sequence finishes, which is what continuous batching needs; nothing is ever compacted.

Every forward also records the experts each MoE layer chose for each token (a forward hook on the routers), in
`model.moe_layers()` order, so the trainer can replay the rollout's routing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.trainer.model.attention import packed_causal_attention
from services.trainer.model.transformer import MoETransformer


class CachedDecoder:
    def __init__(self, model: MoETransformer, slots: int, max_len: int):
        cfg = model.cfg
        if cfg.capacity_factor > 0:
            raise ValueError(f"rollout needs a dropless MoE (model.capacity_factor=0, got {cfg.capacity_factor}): which "
                             "tokens an expert drops depends on the batch they share, so rollout and training would "
                             "compute different policies")
        self.model, self.slots, self.max_len = model, slots, max_len
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # Multi-head Latent Attention's `qkv` gives keys and values expanded to every head, its values narrower
        # than its keys (v_head_dim): cached as such, not as the latent.
        kv_heads = cfg.num_heads if cfg.attention == "mla" else cfg.num_kv_heads
        shape = (len(model.layers), slots, kv_heads, max_len)
        self.k = torch.zeros(*shape, cfg.qk_head_dim, device=self.device, dtype=self.dtype)
        self.v = torch.zeros(*shape, cfg.value_head_dim, device=self.device, dtype=self.dtype)
        self._routers = [m.router for m in model.moe_layers()]
        self._taps: list[torch.Tensor | None] = [None] * len(self._routers)
        self._hooks = [r.register_forward_hook(self._tap(i)) for i, r in enumerate(self._routers)]

    @property
    def num_moe_layers(self) -> int:
        return len(self._routers)

    def _tap(self, i: int):
        def hook(module, inputs, routing):
            self._taps[i] = routing.expert_ids
        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    def _routing(self, tokens: int) -> torch.Tensor:
        """Expert ids of the last forward: [moe layers, tokens, top_k] int64 on the CPU ([0, tokens, 0]: no MoE layer)."""
        if not self._routers:
            return torch.zeros(0, tokens, 0, dtype=torch.int64)
        return torch.stack(self._taps).cpu()

    def _ffn(self, block, x: torch.Tensor) -> torch.Tensor:
        return x + block.mlp(block.mlp_norm(x))

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run whole prompts (packed, document-masked) and fill their slots.

        Returns logits at each prompt's last token [n, V] and the routing of every prompt token [L, Σ len, k].
        """
        lens = [len(p) for p in prompts]
        if min(lens) < 1 or max(lens) > self.max_len:
            raise ValueError(f"prompt lengths must be in [1, {self.max_len}], got {lens}")
        dev = self.device
        tokens = torch.tensor([t for p in prompts for t in p], device=dev)
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        slot_of_token = torch.repeat_interleave(torch.tensor(slots, device=dev), torch.tensor(lens, device=dev))
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=dev)
        cu[1:] = torch.tensor(lens, device=dev).cumsum(0)
        x = self.model.embed(tokens)
        for li, block in enumerate(self.model.layers.values()):
            attn = block.attn
            q, k, v = attn.qkv(block.attn_norm(x), positions)
            self.k[li][slot_of_token, :, positions] = k
            self.v[li][slot_of_token, :, positions] = v
            out = packed_causal_attention(q, k, v, cu, max(lens))
            x = self._ffn(block, x + attn.o_proj(out.reshape(x.shape[0], -1)))
        last = cu[1:].long() - 1
        return self.model.output(self.model.norm(x[last])), self._routing(x.shape[0])

    @torch.no_grad()
    def decode(self, tokens: list[int], slots: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed one token per sequence at `positions` (= tokens already cached in that slot).

        Returns next-token logits [B, V] and the routing of the fed tokens [L, B, k].
        """
        if max(positions) >= self.max_len:
            raise ValueError(f"a sequence reached the cache length {self.max_len}; raise rl.max_seq_len")
        dev = self.device
        tok = torch.tensor(tokens, device=dev)
        slot = torch.tensor(slots, device=dev)
        pos = torch.tensor(positions, device=dev)
        span = max(positions) + 1
        visible = (torch.arange(span, device=dev)[None, :] <= pos[:, None])[:, None, None, :]  # [B, 1, 1, span]
        x = self.model.embed(tok)
        for li, block in enumerate(self.model.layers.values()):
            attn = block.attn
            q, k, v = attn.qkv(block.attn_norm(x), pos)
            self.k[li][slot, :, pos] = k
            self.v[li][slot, :, pos] = v
            keys, values = self.k[li][slot, :, :span], self.v[li][slot, :, :span]  # [B, Hkv, span, d]
            out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=visible,
                                                 enable_gqa=keys.shape[1] != q.shape[1])  # [B, Hq, 1, d]
            x = self._ffn(block, x + attn.o_proj(out.reshape(x.shape[0], -1)))
        return self.model.output(self.model.norm(x)), self._routing(x.shape[0])
