"""Batched autoregressive generation with a KV cache and continuous batching.

`Engine.generate(requests)` keeps up to `max_batch` sequences decoding together. A sequence leaves the batch once the
host has seen it finish (EOS, a stop string, or its token limit) and a waiting prompt takes its cache slot at the next
step, so a long completion never holds a batch of short ones hostage.

Prompts that join together are prefilled together, packed into forwards of at most `prefill_tokens` tokens: a prompt
that does not fit the rest of a forward continues in the next (chunked prefill: a chunk attends to the chunks before it
through the cache), so a forward's activation memory is bounded whatever the prompts' lengths. What a running slot's
cache holds is not prefilled again: a joining prompt copies the longest prefix of it that a running slot's prompt
shares (`_Prefixes`; a group's samples share their whole prompt, prompts may share a system prompt or few-shot
examples) from that slot's cache (`CachedDecoder.copy_prompts`; its routing rows are the holder's) and prefills only the
rest; a prompt held whole has its last token fed by a decode step, which samples its first token.

The host runs one step behind the device: step t + 1 is queued, feeding the tokens step t sampled straight from device
memory, before the host reads step t's tokens, so the host's per-step work (stop checks, routing records) overlaps the
device's instead of adding to it.

Each completion carries the log-prob of every sampled token (see `sampling.py` for which distribution) and the experts
every MoE layer chose for every token the model was fed (prompt and completion but the last token, which is never fed):
routing [moe layers, len(prompt) + len(completion) - 1, top_k], what the trainer replays when it recomputes log-probs.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from services.rl_rollout.kv_cache import CachedDecoder, on_device
from services.rl_rollout.sampling import SamplingParams, sample, truncation_of
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
    shared: int = 0  # prompt positions copied from another slot's cache,
    prompt_from: int | None = None  # that slot, until this sequence's first step lands (its routing rows are copied)
    prompt: tuple[int, ...] = field(init=False)  # the prompt's tokens
    keys: tuple[tuple[int, int], ...] = field(init=False)  # its prefixes' keys in `_Prefixes`

    def __post_init__(self):
        self.prompt = tuple(self.request.prompt_tokens)
        self.keys = _prefix_keys(self.prompt)

    @property
    def fed(self) -> int:
        """Tokens fed to the model once the step in flight has run: the prompt and every sampled token but the last."""
        return len(self.request.prompt_tokens) + self.sampled - 1


@dataclass
class _Step:
    """A queued forward and its sampling: the sequences it feeds, and where its results land on the host."""
    seqs: list[_Running]
    slots: list[int]
    starts: list[int]  # each sequence's first position fed, and how many (a prefill's prompt piece, or one token)
    lens: list[int]
    sampled: list[int]  # the sequences (indices into `seqs`) that sampled a token: all but a prompt's earlier chunks
    tokens: torch.Tensor  # [len(sampled)] sampled ids, host
    logprobs: torch.Tensor  # [len(sampled)], host
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
        self.prefill_tokens = prefill_tokens  # prompt tokens per prefill forward at most (a longer prompt in chunks)
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
        prefixes = _Prefixes()  # the running slots by the prompt prefixes their caches hold

        def finish(slot: int, reason: str) -> None:
            seq = running.pop(slot)
            seq.done = True
            prefixes.remove(slot)
            fed = len(seq.request.prompt_tokens) + len(seq.tokens) - 1
            c = Completion(seq.request.tag, list(seq.request.prompt_tokens), seq.tokens, seq.logprobs,
                           self.routing[slot, :, :fed].to(torch.int64), reason, self.tokenizer.decode(seq.tokens))
            done[seq.index] = c
            if on_complete is not None:
                on_complete(c)

        in_flight: list[_Step] = []
        while waiting or running:
            joining, whole, queued = self._join(waiting, running, prefixes)
            # Every sequence but those just prefilled steps (those copied whole but their last token feed it); one
            # whose last allowed token is sampled waits for it to land (it then finishes by length).
            prefilled = set(joining).difference(whole)
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

    def _join(self, waiting: deque, running: dict[int, _Running], prefixes: _Prefixes
              ) -> tuple[list[int], list[int], list[_Step]]:
        """Give free slots to waiting requests and queue their prompts: the slots that joined, those among them whose
        prompt was copied whole but its last token (the next decode step feeds it, `_next`), and the prefill steps.

        The longest prefix a running slot's cache holds is copied rather than prefilled (at least the last token is
        fed: its logits sample the first token). Sources within the join: fresh prompts (their prefill is queued before
        any copy) and prompts copied in part, once their rest is prefilled: copies run in rounds, round r from sources
        complete before it (so a group's later samples copy its prompt from its first sample, which copied a system
        prompt in round 0). A prompt copied whole but its last token is a source from the next join on."""
        free = [s for s in range(self.max_batch) if s not in running]
        joining, fresh, whole = [], [], []
        rounds: list[list[int]] = []  # the slots copying in round r
        depth: dict[int, int] = {}  # slots of this join complete after round r's prefill: r + 1 (the others: 0)
        while waiting and free:
            index, req = waiting.popleft()
            slot = free.pop(0)
            seq = running[slot] = _Running(index, req)
            joining.append(slot)
            source, n = prefixes.longest(seq)
            n = min(n, len(seq.prompt) - 1)
            if n >= PREFIX_BLOCK or 0 < n == len(seq.prompt) - 1:
                seq.prompt_from, seq.shared = source, n
                r = depth.get(source, 0)
                rounds += [[] for _ in range(r + 1 - len(rounds))]
                rounds[r].append(slot)
                if n == len(seq.prompt) - 1:
                    whole.append(slot)
                    continue
                depth[slot] = r + 1
            else:
                fresh.append(slot)
            prefixes.add(slot, seq)
        for slot in whole:
            prefixes.add(slot, running[slot])
        if joining:
            self._params[:, on_device(joining, self._params.device)] = on_device(
                [running[s].request.params.row for s in joining], self._params.device, torch.float32).T
        queued = self._prefill([(s, 0) for s in fresh], running)
        for copied in rounds:  # a prompt copied in part then has its rest prefilled
            self.cache.copy_prompts([running[s].prompt_from for s in copied], copied,
                                    max(running[s].shared for s in copied))
            self.prompt_tokens_shared += sum(running[s].shared for s in copied)
            queued += self._prefill([(s, running[s].shared) for s in copied if s in depth], running)
        if whole:
            self._next[on_device(whole, self._next.device)] = on_device(
                [running[s].prompt[-1] for s in whole], self._next.device)
        return joining, whole, queued

    def _prefill(self, spans: list[tuple[int, int]], running: dict[int, _Running]) -> list[_Step]:
        """Queue the prefill of each (slot, start): the slot's prompt from position `start` on, in forwards of at most
        `prefill_tokens` tokens (`_pieces`); the forward holding a prompt's last token samples its first token."""
        steps = []
        for batch in _pieces([(s, a, len(running[s].prompt)) for s, a in spans], self.prefill_tokens):
            slots, starts = [s for s, _, _ in batch], [a for _, a, _ in batch]
            lens = [b - a for _, a, b in batch]
            self.prompt_tokens_prefilled += sum(lens)
            logits, routing = self.cache.prefill([running[s].request.prompt_tokens[a:b] for s, a, b in batch], slots,
                                                 starts)
            ends = [i for i, (s, _, b) in enumerate(batch) if b == len(running[s].prompt)]
            steps.append(self._sample(slots, running, logits, routing, starts, lens, ends))
        return steps

    def _sample(self, slots: list[int], running: dict[int, _Running], logits: torch.Tensor, routing: torch.Tensor,
                starts: list[int], lens: list[int], rows: list[int] | None = None) -> _Step:
        """Queue the sampling of the next token of the slots that `rows` names (default: all) after a forward that fed
        each slot `lens[i]` tokens from position `starts[i]` on (`logits`: one row per slot); the copies to the host
        go without a wait."""
        seqs = [running[s] for s in slots]
        rows = list(range(len(slots))) if rows is None else rows
        tokens = logprobs = torch.empty(0)
        if rows:
            if len(rows) < len(slots):
                logits = logits[on_device(rows, logits.device)]
            index = on_device([slots[i] for i in rows], self._next.device)
            tokens, logprobs = sample(logits, self._params[:, index],
                                      truncation_of(seqs[i].request.params for i in rows), self.generator)
            self._next.index_copy_(0, index, tokens)  # what the next decode step feeds
            for i in rows:
                seqs[i].sampled += 1
        ready = None
        tokens, logprobs, routing = _to_host(tokens), _to_host(logprobs), _to_host(routing)
        if self._next.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return _Step(seqs, slots, starts, lens, rows, tokens, logprobs, routing, ready)

    def _land(self, step: _Step, running: dict[int, _Running], finish) -> None:
        """Take a step's results on the host: append each live sequence's token, record the routing of the tokens it
        fed (`routing` [L, Σ lens, k], slot i's `lens[i]` tokens from position `starts[i]` on) and finish the
        sequences that are done. Rows of sequences that ended meanwhile are dropped."""
        if step.ready is not None:
            step.ready.synchronize()  # this step's copies only: the step queued after it keeps running
        live = [i for i, q in enumerate(step.seqs) if not q.done]
        if not live:
            return
        copies: dict[int, tuple[list[int], list[int]]] = {}  # a copied prefix's routing: the source's rows (landed
        for i in live:                                         # before this step, as queued before it), by length
            seq = step.seqs[i]
            if seq.prompt_from is not None:
                dst, src = copies.setdefault(seq.shared, ([], []))
                dst.append(step.slots[i])
                src.append(seq.prompt_from)
                seq.prompt_from = None
        for n, (dst, src) in copies.items():
            self.routing[dst, :, :n] = self.routing[src, :, :n]
        if all(n == 1 for n in step.lens):  # one token a slot (a decode step, or one-token prompts): one indexed write
            self.routing[[step.slots[i] for i in live], :, [step.starts[i] for i in live]] = \
                step.routing[:, live].transpose(0, 1).to(torch.int16)
        else:
            parts = step.routing.split(step.lens, dim=1)
            for i in live:
                self.routing[step.slots[i], :, step.starts[i]:step.starts[i] + step.lens[i]] = parts[i]
        tokens, logprobs = step.tokens.tolist(), step.logprobs.tolist()
        for j, i in enumerate(step.sampled):
            seq = step.seqs[i]
            if seq.done:
                continue
            seq.tokens.append(tokens[j])
            seq.logprobs.append(logprobs[j])
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


def _pieces(spans: list[tuple[int, int, int]], budget: int) -> list[list[tuple[int, int, int]]]:
    """Prompt spans (slot, start, end) in order, cut into forwards of at most `budget` tokens: each forward filled up to
    the budget, a span that does not fit the rest of one continuing in the next."""
    batches, room = [], 0
    for slot, start, end in spans:
        while start < end:
            if not room:
                batches.append([])
                room = budget
            n = min(end - start, room)
            batches[-1].append((slot, start, start + n))
            start, room = start + n, room - n
    return batches


PREFIX_BLOCK = 16  # a prompt prefix shorter than this many tokens is prefilled, not copied (unless all but one token)


@functools.lru_cache(maxsize=256)  # a group's samples join one after another: their prompt's keys computed once
def _prefix_keys(prompt: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(length, hash) of the prompt's first PREFIX_BLOCK, 2·PREFIX_BLOCK, ... tokens and of the whole prompt, each hash
    chained from the one before (so a prefix's key costs one block's hashing)."""
    keys, h = [], 0
    for start in range(0, len(prompt), PREFIX_BLOCK):
        end = min(start + PREFIX_BLOCK, len(prompt))
        h = hash((h, prompt[start:end]))
        keys.append((end, h))
    return tuple(keys)


class _Prefixes:
    """The running slots by the prompt prefixes their caches hold (`_prefix_keys`), for a joining prompt to find the
    longest one. A key only names a candidate: the match is then counted token by token, which also extends it past the
    last matching block. Slots holding the same prompt (a group's samples) are kept together, so the prompt's keys are
    entered and withdrawn once per group."""

    def __init__(self):
        self._holders: dict[tuple[int, int], dict[int, None]] = {}  # a whole prompt's key -> the slots holding it
        self._prompts: dict[tuple[int, int], dict[tuple[int, int], None]] = {}  # a prefix's key -> held prompts' keys
        self._held: dict[int, _Running] = {}

    def add(self, slot: int, seq: _Running) -> None:
        whole = seq.keys[-1]
        slots = self._holders.get(whole)
        if slots is None:
            slots = self._holders[whole] = {}
            for key in seq.keys:
                self._prompts.setdefault(key, {})[whole] = None
        elif self._held[next(iter(slots))].prompt != seq.prompt:
            return  # another prompt of the same hash holds the key: this one is not offered (a 2^-64 event)
        slots[slot] = None
        self._held[slot] = seq

    def remove(self, slot: int) -> None:
        seq = self._held.pop(slot, None)
        if seq is None:
            return
        whole = seq.keys[-1]
        del self._holders[whole][slot]
        if not self._holders[whole]:
            del self._holders[whole]
            for key in seq.keys:
                del self._prompts[key][whole]
                if not self._prompts[key]:
                    del self._prompts[key]

    def longest(self, seq: _Running) -> tuple[int | None, int]:
        """A slot holding the longest prefix of `seq`'s prompt that one holds, and its length (None, 0: none does)."""
        source, n = None, 0
        holders = self._holders.get(seq.keys[-1])
        if holders:  # the whole prompt (a group's samples): no walk
            source, n = next(iter(holders)), len(seq.prompt)
        else:
            for key in seq.keys:
                prompts = self._prompts.get(key)
                if prompts is None:
                    break
                source, n = next(iter(self._holders[next(iter(prompts))])), key[0]
        if source is None:
            return None, 0
        held, prompt = self._held[source].prompt, seq.prompt
        if prompt[:n] != held[:n]:  # equal hashes of unequal prefixes: count from the start
            n = 0
        while n < min(len(prompt), len(held)) and prompt[n] == held[n]:  # past the last matching key: < a block
            n += 1
        return source, n


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host, copied without a wait from a CUDA device into pinned memory: read it after the step's next
    wait for the device (the caching host allocator keeps the buffer until the copy has run)."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
