"""Batched autoregressive generation with a KV cache and continuous batching.

`Engine.generate(requests)` keeps up to `max_batch` sequences decoding together. A sequence leaves the batch the step it
finishes (EOS, a stop string, or its token limit) and a waiting prompt takes its cache slot at the next step, so a long
completion never holds a batch of short ones hostage. Prompts that join together are prefilled together as one packed
batch.

Each completion carries the log-prob of every sampled token (see `sampling.py` for which distribution) and the experts
every MoE layer chose for every token the model was fed (prompt and completion but the last token, which is never fed):
routing [moe layers, len(prompt) + len(completion) - 1, top_k], what the trainer replays when it recomputes log-probs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from services.rl_rollout.kv_cache import CachedDecoder
from services.rl_rollout.sampling import SamplingParams, sample
from services.trainer.model.transformer import MoETransformer


class EngineError(ValueError):
    """A request the engine cannot serve as configured."""


@dataclass
class Request:
    prompt_tokens: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    tag: Any = None  # returned unchanged on the completion (e.g. group id and sample index)


@dataclass
class Completion:
    tag: Any
    prompt_tokens: list[int]
    tokens: list[int]  # sampled tokens, including the EOS or the token that completed a stop string
    logprobs: list[float]  # one per sampled token
    routing: torch.Tensor  # [moe layers, len(prompt_tokens) + len(tokens) - 1, top_k] int64 expert ids
    finish_reason: str  # "eos", "stop" or "length"
    text: str = ""


@dataclass
class _Running:
    index: int
    request: Request
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    @property
    def fed(self) -> int:
        """Tokens fed to the model so far: the prompt and every sampled token but the last."""
        return len(self.request.prompt_tokens) + len(self.tokens) - 1


class Engine:
    """Generation over a model that the caller owns (and may reload weights into between `generate` calls)."""

    def __init__(self, model: MoETransformer, tokenizer, max_batch: int = 32, max_seq_len: int = 256, seed: int = 0,
                 cuda_graphs: bool = True):
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.cache = CachedDecoder(model, max_batch, max_seq_len, cuda_graphs)  # decode steps as CUDA graphs on GPU
        self.generator = torch.Generator(self.cache.device).manual_seed(seed)
        # Each slot's routing, position by position, written once per step for all sequences together (a host
        # tensor of int16 ids: slots x layers x max_seq_len x top_k x 2 B); a completion copies its slot's rows.
        layers = self.cache.num_moe_layers
        top_k = model.cfg.top_k if layers else 0
        if layers and model.cfg.num_experts > torch.iinfo(torch.int16).max:
            raise EngineError(f"{model.cfg.num_experts} experts do not fit the routing record's int16 ids")
        self.routing = torch.empty(max_batch, layers, max_seq_len, top_k, dtype=torch.int16)

    def close(self) -> None:
        self.cache.close()

    def generate(self, requests: list[Request],
                 on_complete: Callable[[Completion], None] | None = None) -> list[Completion]:
        """Completions in request order; `on_complete` is also called as each one finishes (in finishing order)."""
        for r in requests:
            need = len(r.prompt_tokens) + r.params.max_tokens
            if not r.prompt_tokens or need > self.max_seq_len:
                raise EngineError(f"a prompt of {len(r.prompt_tokens)} tokens with max_tokens={r.params.max_tokens} "
                                  f"needs {need} cache positions; the engine has max_seq_len={self.max_seq_len} "
                                  "(raise rl.max_seq_len or shorten prompts)")
        was_training = self.model.training
        self.model.eval()
        try:
            return self._run(requests, on_complete)
        finally:
            self.model.train(was_training)

    def _run(self, requests, on_complete):
        waiting = deque(enumerate(requests))
        running: dict[int, _Running] = {}  # slot -> sequence
        done: list[Completion | None] = [None] * len(requests)

        def finish(slot: int, reason: str) -> None:
            seq = running.pop(slot)
            c = Completion(seq.request.tag, list(seq.request.prompt_tokens), seq.tokens, seq.logprobs,
                           self.routing[slot, :, :seq.fed].to(torch.int64), reason, self.tokenizer.decode(seq.tokens))
            done[seq.index] = c
            if on_complete is not None:
                on_complete(c)

        while waiting or running:
            free = [s for s in range(self.max_batch) if s not in running]
            joining = []
            while waiting and free:
                index, req = waiting.popleft()
                slot = free.pop(0)
                running[slot] = _Running(index, req)
                joining.append(slot)
            if joining:
                logits, routing = self.cache.prefill([running[s].request.prompt_tokens for s in joining], joining)
                lens = [len(running[s].request.prompt_tokens) for s in joining]
                self._append(joining, logits, _to_host(routing), running, finish, [0] * len(joining), lens)
            stepping = [s for s in running if s not in joining]
            if stepping:
                positions = [running[s].fed for s in stepping]
                logits, routing = self.cache.decode([running[s].tokens[-1] for s in stepping], stepping, positions)
                self._append(stepping, logits, _to_host(routing), running, finish, positions, [1] * len(stepping))
        return done

    def _append(self, slots: list[int], logits: torch.Tensor, routing: torch.Tensor, running: dict[int, _Running],
                finish, starts: list[int], lens: list[int]) -> None:
        """Sample each slot's next token and record the routing of the tokens just fed: `routing` [L, Σ lens, k], slot
        i's `lens[i]` tokens from position `starts[i]` on (a prefill's prompts, or a decode step's one token each)."""
        tokens, logprobs = sample(logits, [running[s].request.params for s in slots], self.generator)
        tokens, logprobs = tokens.tolist(), logprobs.tolist()  # the step's wait for the device: its routing is here too
        if all(n == 1 for n in lens):  # one token a slot (a decode step, or one-token prompts): one indexed write
            self.routing[torch.tensor(slots), :, torch.tensor(starts)] = routing.transpose(0, 1).to(torch.int16)
        else:
            for s, at, part in zip(slots, starts, routing.split(lens, dim=1)):
                self.routing[s, :, at:at + part.shape[1]] = part
        for s, t, lp in zip(slots, tokens, logprobs):
            seq = running[s]
            seq.tokens.append(t)
            seq.logprobs.append(lp)
            reason = self._finished(seq)
            if reason:
                finish(s, reason)

    def _finished(self, seq: _Running) -> str:
        p = seq.request.params
        if p.stop_at_eos and seq.tokens[-1] == self.tokenizer.eos_id:
            return "eos"
        if p.stop:
            # Only the tail can hold a newly completed stop string; a token decodes to at least one character (or a
            # fragment of one), so 4 tokens per character of the longest stop string is always enough.
            tail = self.tokenizer.decode(seq.tokens[-4 * max(len(s) for s in p.stop) - 4:])
            if any(s in tail for s in p.stop):
                return "stop"
        if len(seq.tokens) >= p.max_tokens:
            return "length"
        return ""


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host, copied without a wait from a CUDA device into pinned memory: read it after the step's next
    wait for the device (the caching host allocator keeps the buffer until the copy has run)."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
