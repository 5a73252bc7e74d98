"""A cached forward pass over the trainer's `MoETransformer`: prefill a packed batch of prompts, then decode one token per
sequence per step, reusing the model's own modules and weights (embedding, norms, the attention's projections and
RoPE, MLP/MoE, output layer). Only attention differs: prefill uses the model's packed causal attention and stores
what later tokens need, decode attends one query per sequence to its sequence's cache, read in place by slot on CUDA
(kernels/decode_attention.py for GQA, kernels/decode_latent_attention.py for MLA).

What is cached depends on the attention (one class each, same methods):
- GQA (`HeadCache`): keys and values of every key/value head, 2·kv_heads·head_dim values per token and layer.
- Multi-head Latent Attention (`LatentCache`): the normalised latent and the shared RoPE key, kv_lora_rank +
  qk_rope_head_dim values per token and layer (DeepSeek-V3: 576, against 40,960 for its 128 heads' keys and values
  expanded); decode absorbs kv_b_proj into the query and the output instead of expanding (mla.py `attend_latent`).

The cache is slot based: `slots` sequences of at most `max_len` tokens, one slot per running sequence. A slot is reused
as soon as its sequence finishes, which is what continuous batching needs; nothing is ever compacted.

Decode steps run at fixed shapes: the batch padded to a power of two (at most `slots`) and the keys attended to the
next power of two of the longest sequence (at least 16, at most `max_len`), masked. Padding rows decode token 0 at
position 0 of one spare slot past the real ones, so they write nothing a sequence reads. On CUDA each (batch, span)
shape is captured once as a CUDA graph (`cuda_graphs`, `rl.cuda_graphs`) and replayed: a decode step at rollout batch
sizes is launch-bound (bench/RESULTS.md), and a replay issues the step's hundreds of kernels at once. The MoE layers'
dropless path reads its expert counts on the device (tests/test_moe_sync_free.py), so nothing in a step waits for the
host. Weights reload in place (`load_state_dict`), which the graphs see. Prefill runs eagerly (shapes vary): packed
prompt pieces, each continuing what its slot's cache holds before it (a chunk of a long prompt, or the rest of a prompt
whose prefix was copied from another slot, `copy_prompts`) by attending to those cached positions too.

Every forward also records the experts each MoE layer chose for each token (a forward hook on the routers), in
layer order, so the trainer can replay the rollout's routing. A model's multi-token prediction depths (training only)
are not run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.decode_attention import decode_attention
from services.common.config import ModelConfig
from services.trainer.model.attention import packed_causal_attention
from services.trainer.model.transformer import MoETransformer


class HeadCache:
    """Per-head keys and values: [layers, slots, kv heads, max_len, head dim]."""

    def __init__(self, cfg: ModelConfig, slots: int, max_len: int, device, dtype):
        shape = (cfg.num_layers, slots, cfg.num_kv_heads, max_len)
        self.k = torch.zeros(*shape, cfg.qk_head_dim, device=device, dtype=dtype)
        self.v = torch.zeros(*shape, cfg.value_head_dim, device=device, dtype=dtype)
        self.tensors = (self.k, self.v)

    def prefill(self, li: int, attn, h, fed: _Fed) -> torch.Tensor:
        q, k, v = attn.qkv(h, fed.positions)
        self.k[li][fed.slots, :, fed.positions] = k
        self.v[li][fed.slots, :, fed.positions] = v
        if fed.keys is None:
            return packed_causal_attention(q, k, v, fed.cu, fed.max_len)
        keys = fed.keys
        k, v = self.k[li][keys.slots, :, keys.positions], self.v[li][keys.slots, :, keys.positions]
        return packed_causal_attention(q, k, v, fed.cu, fed.max_len, keys.cu, keys.max_len)

    def decode(self, li: int, attn, h, slot, pos, span: int) -> torch.Tensor:
        q, k, v = attn.qkv(h, pos)
        self.k[li][slot, :, pos] = k
        self.v[li][slot, :, pos] = v
        return decode_attention(q, self.k[li], self.v[li], slot, pos, span)

    def copy(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Positions 0 .. length - 1 of slots `src` into slots `dst`, every layer."""
        for t in self.tensors:
            t[:, dst, :, :length] = t[:, src, :, :length]


class LatentCache:
    """MLA's latent and shared RoPE key: [layers, slots, max_len, kv_lora_rank] and [..., qk_rope_head_dim]."""

    def __init__(self, cfg: ModelConfig, slots: int, max_len: int, device, dtype):
        shape = (cfg.num_layers, slots, max_len)
        self.latent = torch.zeros(*shape, cfg.kv_lora_rank, device=device, dtype=dtype)
        self.k_rope = torch.zeros(*shape, cfg.qk_rope_head_dim, device=device, dtype=dtype)
        self.tensors = (self.latent, self.k_rope)

    def prefill(self, li: int, attn, h, fed: _Fed) -> torch.Tensor:
        q, latent, k_rope = attn.query_and_latent(h, fed.positions)
        self.latent[li][fed.slots, fed.positions] = latent
        self.k_rope[li][fed.slots, fed.positions] = k_rope
        if fed.keys is None:  # a prompt at once: expanded
            return packed_causal_attention(q, *attn.expand(latent, k_rope), fed.cu, fed.max_len)
        keys = fed.keys
        latent, k_rope = self.latent[li][keys.slots, keys.positions], self.k_rope[li][keys.slots, keys.positions]
        return packed_causal_attention(q, *attn.expand(latent, k_rope), fed.cu, fed.max_len, keys.cu, keys.max_len)

    def decode(self, li: int, attn, h, slot, pos, span: int) -> torch.Tensor:
        q, latent, k_rope = attn.query_and_latent(h, pos)
        self.latent[li][slot, pos] = latent
        self.k_rope[li][slot, pos] = k_rope
        return attn.attend_latent(q, self.latent[li], self.k_rope[li], slot, pos, span)

    def copy(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Positions 0 .. length - 1 of slots `src` into slots `dst`, every layer."""
        for t in self.tensors:
            t[:, dst, :length] = t[:, src, :length]


@dataclass
class _Fed:
    """A prefill forward's packed segments: each token's slot and position (where the cache keeps it), the segments'
    bounds `cu` [segments + 1] and the longest's length (a host number); and `keys`, the cached positions each segment
    attends to, laid out the same way, where a segment continues a prefix (None: each attends to its own tokens)."""
    slots: torch.Tensor
    positions: torch.Tensor
    cu: torch.Tensor
    max_len: int
    keys: _Fed | None = None

    @staticmethod
    def pack(slots: list[int], starts: list[int], ends: list[int], device) -> _Fed:
        lens = torch.tensor([b - a for a, b in zip(starts, ends)])
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = lens.cumsum(0)
        positions = torch.cat([torch.arange(a, b) for a, b in zip(starts, ends)])
        return _Fed(on_device(torch.repeat_interleave(torch.tensor(slots), lens), device),
                    on_device(positions, device), on_device(cu, device), int(lens.max()))


def on_device(values: list | torch.Tensor, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Host `values` (a list, as `dtype`, or a tensor) on `device`, copied from pinned memory on CUDA: no wait for the
    work queued there (a copy from pageable memory would wait for it, and the host would stop running ahead)."""
    cuda = device.type == "cuda"
    if isinstance(values, list):
        return torch.tensor(values, dtype=dtype, pin_memory=cuda).to(device, non_blocking=cuda)
    return (values.pin_memory() if cuda else values).to(device, non_blocking=cuda)


def _bucket(n: int, least: int, most: int) -> int:
    """The smallest power of two >= max(n, least), capped at `most`."""
    return min(1 << (max(n, least) - 1).bit_length(), most)


class _DecodeStep:
    """One decode shape: its input buffer [3, batch] (tokens, slots, positions) and a call that runs the step on it,
    returning (logits [batch, V], routing [L, batch, k] or None): a CUDA graph's replay or the eager forward."""

    def __init__(self, inputs: torch.Tensor, run):
        self.inputs, self.run = inputs, run


class CachedDecoder:
    def __init__(self, model: MoETransformer, slots: int, max_len: int, cuda_graphs: bool = True):
        cfg = model.cfg
        if cfg.capacity_factor > 0:
            raise ValueError(f"rollout generates with a dropless MoE (model.capacity_factor=0, got "
                             f"{cfg.capacity_factor}): which tokens an expert drops depends on the batch they share, "
                             "and decode batches are not the trainer's micro-batches; build the engine's model from "
                             "worker.rollout_model_config (the trainer's config, dropless)")
        self.model, self.slots, self.max_len = model, slots, max_len
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        cache = LatentCache if cfg.attention == "mla" else HeadCache
        self.cache = cache(cfg, slots + 1, max_len, self.device, self.dtype)  # slot `slots`: padding rows'
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self._steps: dict[tuple[int, int], _DecodeStep] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        # The main model's MoE layers, in order (`model.moe_layers()` without multi-token prediction's, which
        # decoding does not run)
        self._routers = [block.mlp.router for block in model.layers.values() if block.is_moe]
        self._taps: list[torch.Tensor | None] = [None] * len(self._routers)
        self._hooks = [r.register_forward_hook(self._tap(i)) for i, r in enumerate(self._routers)]

    @property
    def num_moe_layers(self) -> int:
        return len(self._routers)

    @property
    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.cache.tensors)

    def _tap(self, i: int):
        def hook(module, inputs, routing):
            self._taps[i] = routing.expert_ids
        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    def _routing(self, tokens: int) -> torch.Tensor:
        """Expert ids of the last forward: [moe layers, tokens, top_k] int64 on the device ([0, tokens, 0]: no MoE
        layer)."""
        if not self._routers:
            return torch.zeros(0, tokens, 0, dtype=torch.int64, device=self.device)
        return torch.stack(self._taps)

    def _block(self, block, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        x = x + block.attn.o_proj(attention.reshape(x.shape[0], -1))
        return x + block.mlp(block.mlp_norm(x))

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], slots: list[int], starts: list[int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run prompt pieces (packed, document-masked) and fill their slots: `prompts[i]` is fed at positions
        `starts[i]` onwards (default 0) and attends to its slot's cached positions before them too: a chunk of a longer
        prompt, or the rest of a prompt whose first positions were copied from another slot (`copy_prompts`).

        Returns logits at each piece's last token [n, V] and the routing of every token fed [L, Σ len, k], both on the
        device.
        """
        starts = starts or [0] * len(prompts)
        lens = [len(p) for p in prompts]
        ends = [a + n for a, n in zip(starts, lens)]
        if min(lens) < 1 or min(starts) < 0 or max(ends) > self.max_len:
            raise ValueError(f"prompt pieces must be non-empty and lie in positions [0, {self.max_len}), got starts "
                             f"{starts} and lengths {lens}")
        fed = _Fed.pack(slots, starts, ends, self.device)
        if any(starts):
            fed.keys = _Fed.pack(slots, [0] * len(slots), ends, self.device)
        x = self.model.embed(on_device([t for p in prompts for t in p], self.device))
        for li, block in enumerate(self.model.layers.values()):
            x = self._block(block, x, self.cache.prefill(li, block.attn, block.attn_norm(x), fed))
        last = fed.cu[1:].long() - 1
        return self.model.output(self.model.norm(x[last])), self._routing(x.shape[0])

    @torch.no_grad()
    def copy_prompts(self, src: list[int], dst: list[int], length: int) -> None:
        """Give slots `dst` the cached positions 0 .. length - 1 of slots `src` (pairwise; a slot of `dst` must not be
        in `src`): a prompt another slot holds, shared instead of prefilled again. Positions past a prompt's own
        length are copied too when prompts of several lengths share a call: a slot writes each position before it
        attends to it, so they are never read."""
        if src and length > 0:
            index = on_device([src, dst], self.device)
            self.cache.copy(index[0], index[1], length)

    @torch.no_grad()
    def decode(self, tokens_by_slot: torch.Tensor, slots: list[int], positions: list[int]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed one token per sequence in `slots` at `positions` (= tokens already cached in that slot): the slot's
        entry of `tokens_by_slot` ([slots + 1] on the device, the last entry the padding rows' token, 0), read on the
        device, so the tokens a step feeds may still be being sampled when it is queued.

        Returns next-token logits [B, V] and the routing of the fed tokens [L, B, k], both on the device. Replayed from
        a CUDA graph they are views of its output buffers, which the next decode step of the same shape overwrites:
        queue what reads them (the engine's sampling and copy to the host) before that step.
        """
        if max(positions) >= self.max_len:
            raise ValueError(f"a sequence reached the cache length {self.max_len}; raise rl.max_seq_len")
        n = len(slots)
        batch, span = _bucket(n, 1, self.slots), _bucket(max(positions) + 1, 16, self.max_len)
        step = self._steps.get((batch, span)) or self._new_step(batch, span)
        pad = batch - n
        inputs = torch.tensor([slots + [self.slots] * pad, positions + [0] * pad], pin_memory=self.device.type == "cuda")
        step.inputs[1:].copy_(inputs, non_blocking=True)  # from pinned memory (on CUDA): no wait for the device
        torch.index_select(tokens_by_slot, 0, step.inputs[1], out=step.inputs[0])
        logits, routing = step.run()
        return logits[:n], self._routing(n) if routing is None else routing[:, :n]

    def _forward(self, inputs: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decode step on `inputs` [3, batch], attending to the first `span` cache positions (masked)."""
        tok, slot, pos = inputs
        x = self.model.embed(tok)
        for li, block in enumerate(self.model.layers.values()):
            x = self._block(block, x, self.cache.decode(li, block.attn, block.attn_norm(x), slot, pos, span))
        return self.model.output(self.model.norm(x)), (torch.stack(self._taps) if self._routers else None)

    def _new_step(self, batch: int, span: int) -> _DecodeStep:
        inputs = torch.zeros(3, batch, dtype=torch.int64, device=self.device)
        inputs[1] = self.slots  # every row padding until a step fills it: warm-up and capture write the spare slot
        if not self.cuda_graphs:
            step = _DecodeStep(inputs, lambda: self._forward(inputs, span))
        else:
            # Warm up on a side stream first (Triton's autotuning and lazy initialisations must not run under capture).
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(inputs, span)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                outputs = self._forward(inputs, span)

            def replay():
                graph.replay()
                return outputs
            step = _DecodeStep(inputs, replay)
        self._steps[(batch, span)] = step
        return step
