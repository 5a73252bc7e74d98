"""Batched autoregressive generation with a KV cache and continuous batching.

`Engine.generate(requests)` keeps up to `max_batch` sequences decoding together. A sequence leaves the batch once the
host has seen it finish (EOS, a stop string, or its token limit) and a waiting prompt takes its cache slot at the next
step, so a long completion never holds a batch of short ones hostage. Prompts that join together are prefilled together
as packed batches of at most `prefill_tokens` tokens (a longer prompt alone), except a prompt that a running slot
already holds (a group's samples share one prompt): that one is copied from the holder's cache, all but its last token,
which a decode step feeds (`CachedDecoder.copy_prompts`; its routing rows are the holder's), so a group's prompt is
prefilled again only when none of its samples is running. The host runs one step behind the device: step t + 1 is
queued, feeding the tokens step t sampled straight from device memory, before the host reads step t's tokens, so the
host's per-step work (stop checks, routing records) overlaps the device's instead of adding to it.

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
    tokens: list[int] = field(default_factory=list)  # sampled tokens whose values have reached the host
    logprobs: list[float] = field(default_factory=list)
    sampled: int = 0  # tokens sampled on the device, the step in flight's included
    done: bool = False
    prompt_from: int | None = None  # the slot whose cached prompt it shares, until its first step lands
    prompt: tuple[int, ...] = field(init=False)  # the prompt's tokens, hashable (`Engine._run`'s holders)

    def __post_init__(self):
        self.prompt = tuple(self.request.prompt_tokens)

    @property
    def fed(self) -> int:
        """Tokens fed to the model once the step in flight has run: the prompt and every sampled token but the last."""
        return len(self.request.prompt_tokens) + self.sampled - 1


@dataclass
class _Step:
    """A queued forward and its sampling: the sequences it advances, and where its results land on the host."""
    seqs: list[_Running]
    slots: list[int]
    starts: list[int]  # each sequence's first position fed, and how many (a prefill's prompt, or one token)
    lens: list[int]
    tokens: torch.Tensor  # [n] sampled ids, host
    logprobs: torch.Tensor  # [n], host
    routing: torch.Tensor  # [L, Σ lens, k] expert ids of the fed tokens, host
    ready: torch.cuda.Event | None  # recorded after the copies to the host (None: computed on the host)


class Engine:
    """Generation over a model that the caller owns (and may reload weights into between `generate` calls)."""

    def __init__(self, model: MoETransformer, tokenizer, max_batch: int = 32, max_seq_len: int = 256, seed: int = 0,
                 cuda_graphs: bool = True, prefill_tokens: int = 16384):
        if min(max_batch, max_seq_len, prefill_tokens) < 1:
            raise EngineError(f"max_batch, max_seq_len and prefill_tokens must be at least 1, got {max_batch}, "
                              f"{max_seq_len} and {prefill_tokens}")
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.prefill_tokens = prefill_tokens  # prompt tokens per prefill forward at most (a longer prompt alone)
        # Prompt tokens run through prefill, and copied from another slot's cache instead (since construction)
        self.prompt_tokens_prefilled = self.prompt_tokens_shared = 0
        self.cache = CachedDecoder(model, max_batch, max_seq_len, cuda_graphs)  # decode steps as CUDA graphs on GPU
        self.generator = torch.Generator(self.cache.device).manual_seed(seed)
        # Each slot's routing, position by position, written once per step for all sequences together (a host
        # tensor of int16 ids: slots x layers x max_seq_len x top_k x 2 B); a completion copies its slot's rows.
        layers = self.cache.num_moe_layers
        top_k = model.cfg.top_k if layers else 0
        if layers and model.cfg.num_experts > torch.iinfo(torch.int16).max:
            raise EngineError(f"{model.cfg.num_experts} experts do not fit the routing record's int16 ids")
        self.routing = torch.empty(max_batch, layers, max_seq_len, top_k, dtype=torch.int16)
        # Each slot's next token to feed, on the device, written by the sampling (entry `max_batch`: padding rows', 0)
        self._next = torch.zeros(max_batch + 1, dtype=torch.int64, device=self.cache.device)
        # Each slot's sampling parameters (`SamplingParams.row`: temperature, top_k, top_p), on the device, written
        # when a sequence joins
        self._params = torch.zeros(3, max_batch, dtype=torch.float32, device=self.cache.device)

    def close(self) -> None:
        self.cache.close()

    def generate(self, requests: list[Request],
                 on_complete: Callable[[Completion], None] | None = None) -> list[Completion]:
        """Completions in request order; `on_complete` is also called as each one finishes (in finishing order)."""
        vocab = self.model.cfg.vocab_size
        for i, r in enumerate(requests):
            need = len(r.prompt_tokens) + r.params.max_tokens
            if not r.prompt_tokens or need > self.max_seq_len:
                raise EngineError(f"a prompt of {len(r.prompt_tokens)} tokens with max_tokens={r.params.max_tokens} "
                                  f"needs {need} cache positions; the engine has max_seq_len={self.max_seq_len} "
                                  "(raise rl.max_seq_len or shorten prompts)")
            # on a GPU an id past the embedding is a device-side assert that takes the process's CUDA context with it
            if not 0 <= min(r.prompt_tokens) <= max(r.prompt_tokens) < vocab:
                raise EngineError(f"request {i}'s prompt holds token ids in [{min(r.prompt_tokens)}, "
                                  f"{max(r.prompt_tokens)}], outside the model's vocabulary of {vocab}: was it encoded "
                                  "with another tokenizer than the model's (data.tokenizer, model.vocab_size)?")
        was_training = self.model.training
        self.model.eval()
        try:
            return self._run(requests, on_complete)
        finally:
            self.model.train(was_training)

    def _run(self, requests, on_complete):
        """Steps are queued one ahead of the host: a decode step reads the tokens it feeds on the device (`_next`), so
        it is queued before the previous step's tokens reach the host, and the host's bookkeeping of step t (stop
        checks, routing records, finishing) runs while step t + 1 computes. The cost: a sequence that ends on a token
        the host has not seen yet (EOS, a stop string) is fed once more; that row is discarded."""
        waiting = deque(enumerate(requests))
        running: dict[int, _Running] = {}  # slot -> sequence
        done: list[Completion | None] = [None] * len(requests)
        holders: dict[tuple[int, ...], set[int]] = {}  # prompt -> the running slots whose cache holds it

        def finish(slot: int, reason: str) -> None:
            seq = running.pop(slot)
            seq.done = True
            holders[seq.prompt].discard(slot)
            if not holders[seq.prompt]:
                del holders[seq.prompt]
            fed = len(seq.request.prompt_tokens) + len(seq.tokens) - 1
            c = Completion(seq.request.tag, list(seq.request.prompt_tokens), seq.tokens, seq.logprobs,
                           self.routing[slot, :, :fed].to(torch.int64), reason, self.tokenizer.decode(seq.tokens))
            done[seq.index] = c
            if on_complete is not None:
                on_complete(c)

        in_flight: list[_Step] = []
        while waiting or running:
            free = [s for s in range(self.max_batch) if s not in running]
            joining, fresh, shared = [], [], []
            while waiting and free:
                index, req = waiting.popleft()
                slot = free.pop(0)
                seq = running[slot] = _Running(index, req)
                joining.append(slot)
                # A prompt a running slot holds (a group's samples share one) is copied from its cache, not prefilled
                # again; the fresh ones of this batch are sources too (their prefill is queued before the copies)
                source = next(iter(holders.get(seq.prompt, ())), None) if len(seq.prompt) > 1 else None
                if source is None:
                    fresh.append(slot)
                    holders.setdefault(seq.prompt, set()).add(slot)
                else:
                    seq.prompt_from = source
                    shared.append(slot)
            for slot in shared:
                holders[running[slot].prompt].add(slot)
            queued = []
            if joining:
                self._params[:, _on_device(joining, self._params.device)] = _on_device(
                    [running[s].request.params.row for s in joining], self._params.device, torch.float32).T
            for batch in _batches(fresh, [len(running[s].prompt) for s in fresh], self.prefill_tokens):
                lens = [len(running[s].prompt) for s in batch]
                self.prompt_tokens_prefilled += sum(lens)
                logits, routing = self.cache.prefill([running[s].request.prompt_tokens for s in batch], batch)
                queued.append(self._sample(batch, running, logits, routing, [0] * len(batch), lens))
            if shared:
                # All but the last prompt token copied; the last is fed by the decode step below, which samples the
                # first token (its routing rows are copied when that step lands, `_land`)
                self.cache.copy_prompts([running[s].prompt_from for s in shared], shared,
                                        max(len(running[s].prompt) for s in shared) - 1)
                self.prompt_tokens_shared += sum(len(running[s].prompt) - 1 for s in shared)
                self._next[_on_device(shared, self._next.device)] = _on_device(
                    [running[s].prompt[-1] for s in shared], self._next.device)
            # Every sequence but those just prefilled steps (the shared prompts' joiners feed their last prompt token);
            # one whose last allowed token is sampled waits for it to land (it then finishes by length).
            prefilled = set(fresh)
            stepping = [s for s in running if s not in prefilled
                        and running[s].sampled < running[s].request.params.max_tokens]
            if stepping:
                positions = [running[s].fed for s in stepping]
                logits, routing = self.cache.decode(self._next, stepping, positions)
                queued.append(self._sample(stepping, running, logits, routing, positions, [1] * len(stepping)))
            if not queued and not in_flight:
                raise RuntimeError("generation made no progress")  # unreachable: every running sequence steps or lands
            for step in in_flight:
                self._land(step, running, finish)
            in_flight = queued
        return done

    def _sample(self, slots: list[int], running: dict[int, _Running], logits: torch.Tensor, routing: torch.Tensor,
                starts: list[int], lens: list[int]) -> _Step:
        """Queue the sampling of each slot's next token after a forward; its copies to the host go without a wait."""
        seqs = [running[s] for s in slots]
        index = _on_device(slots, self._next.device)
        tokens, logprobs = sample(logits, self._params[:, index], any(q.request.params.truncates for q in seqs),
                                  self.generator)
        self._next.index_copy_(0, index, tokens)  # what the next decode step feeds
        for q in seqs:
            q.sampled += 1
        ready = None
        tokens, logprobs, routing = _to_host(tokens), _to_host(logprobs), _to_host(routing)
        if self._next.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return _Step(seqs, slots, starts, lens, tokens, logprobs, routing, ready)

    def _land(self, step: _Step, running: dict[int, _Running], finish) -> None:
        """Take a step's results on the host: append each live sequence's token, record the routing of the tokens it
        fed (`routing` [L, Σ lens, k], slot i's `lens[i]` tokens from position `starts[i]` on) and finish the
        sequences that are done. Rows of sequences that ended meanwhile are dropped."""
        if step.ready is not None:
            step.ready.synchronize()  # this step's copies only: the step queued after it keeps running
        live = [i for i, q in enumerate(step.seqs) if not q.done]
        if not live:
            return
        for i in live:  # a shared prompt's routing: the source's rows (landed with its prefill, before this step)
            seq = step.seqs[i]
            if seq.prompt_from is not None:
                n = len(seq.prompt) - 1
                self.routing[step.slots[i], :, :n] = self.routing[seq.prompt_from, :, :n]
                seq.prompt_from = None
        if all(n == 1 for n in step.lens):  # one token a slot (a decode step, or one-token prompts): one indexed write
            self.routing[[step.slots[i] for i in live], :, [step.starts[i] for i in live]] = \
                step.routing[:, live].transpose(0, 1).to(torch.int16)
        else:
            parts = step.routing.split(step.lens, dim=1)
            for i in live:
                self.routing[step.slots[i], :, step.starts[i]:step.starts[i] + step.lens[i]] = parts[i]
        tokens, logprobs = step.tokens.tolist(), step.logprobs.tolist()
        for i in live:
            seq = step.seqs[i]
            seq.tokens.append(tokens[i])
            seq.logprobs.append(logprobs[i])
            reason = self._finished(seq)
            if reason:
                finish(step.slots[i], reason)

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


def _batches(slots: list[int], lens: list[int], budget: int) -> list[list[int]]:
    """`slots` in order, cut into runs whose `lens` sum to at most `budget` (a slot longer than that alone)."""
    batches, total = [], budget
    for slot, n in zip(slots, lens):
        if total + n > budget:
            batches.append([])
            total = 0
        batches[-1].append(slot)
        total += n
    return batches


def _on_device(values: list, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`values` as a tensor on `device`, copied from pinned memory on CUDA: no wait for the work queued there."""
    cuda = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=cuda).to(device, non_blocking=cuda)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host, copied without a wait from a CUDA device into pinned memory: read it after the step's next
    wait for the device (the caching host allocator keeps the buffer until the copy has run)."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
