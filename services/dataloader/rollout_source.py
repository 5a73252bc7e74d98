"""RL source: trajectory groups from the rollout Redis stream, packed into micro-batches instead of corpus documents.

Input: one stream entry per group (field "group" = a serialized `foldmoe.v1.TrajectoryGroup`, proto/rollout.proto); the
key is `data.rollout_stream`, or (empty) the "stream" of a rollout worker's registry record. Each sample becomes one
document, prompt + completion, packed by best-fit-decreasing over windows of `data.packing_window // rl.group_size`
groups; a sample longer than seq_len+1 tokens is dropped and counted (cutting it would change what its log-probs were
conditioned on). Advantages are computed per group (GRPO: reward minus the group mean, divided by the group standard
deviation when `rl.std_normalize`), before packing spreads a group over micro-batches and dp ranks.

Entries are read without deleting them, so a position is just (id of the entry before the current window, id of its
first entry, sequences of that window already emitted) and a restarted service replays exactly; a position whose
entries were trimmed already is refused (the first id no longer follows), never silently replaced by later entries.
An entry is trimmed from the stream `max_buffered` steps after every rank has moved past the step that used it (a rank
that dies with prefetched micro-batches unread resumes a little earlier); the stream length stays the backlog the
rollout workers throttle on.

Extra per-token tensors of an RL micro-batch, next to the contract's tokens/labels/position_ids/cu_seqlens (all of
length T and aligned with `tokens`; input position i predicts labels[i] = the document's token i+1):
  loss_mask         bool [T]                   True where the label is a completion token (an action of the policy);
                                               prompt, and padding positions are False (their labels are -100 too)
  rollout_logprobs  float32 [T]                log pi_rollout(labels[i]) as the rollout engine sampled it; 0 off the mask
  advantages        float32 [T]                the sample's group-relative advantage on its masked positions; 0 elsewhere
  rewards           float32 [T]                the sample's scalar reward on its masked positions; 0 elsewhere
  routing_ids       int32 [T, moe_layers, top_k]  experts each MoE layer chose for input token i at rollout (routing
                                               replay); -1 on padding
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import redis
import torch
from torchdata.nodes import BaseNode

from proto import rollout_pb2
from services.dataloader.errors import DataError
from services.dataloader.packing import best_fit_decreasing
from services.dataloader.stream import MicroBatch, StepStream

START = "0-0"  # the id before every entry


@dataclass(frozen=True, eq=False)
class RLSample:
    """One trajectory as a document: prompt + completion tokens and what the loss needs per completion token."""

    tokens: np.ndarray  # int64 [P + C]
    prompt_len: int  # P
    logprobs: np.ndarray  # float32 [C]
    routing: np.ndarray  # int32 [P + C - 1, moe_layers, top_k]
    reward: float
    advantage: float

    @property
    def positions(self) -> int:
        return len(self.tokens) - 1


def group_samples(group: rollout_pb2.TrajectoryGroup, std_normalize: bool, layers: int, top_k: int) -> list[RLSample]:
    """The samples of one group with their GRPO advantages; DataError when the routing does not fit the model."""
    if group.samples and (group.moe_layers, group.top_k) != (layers, top_k):
        raise DataError(f"group {group.group_id} records routing for {group.moe_layers} MoE layers x top-{group.top_k} "
                        f"but the model has {layers} x top-{top_k}: run the rollout workers with the trainer's model config")
    rewards = np.array([s.reward for s in group.samples], dtype=np.float64)
    adv = rewards - rewards.mean() if len(rewards) else rewards
    if std_normalize and len(rewards) > 1:
        adv = adv / (rewards.std(ddof=1) + 1e-6)
    prompt = np.array(group.prompt_tokens, dtype=np.int64)
    out = []
    for s, a in zip(group.samples, adv):
        tokens = np.concatenate([prompt, np.array(s.tokens, dtype=np.int64)])
        fed = len(tokens) - 1
        routing = np.array(s.routing, dtype=np.int32)
        if routing.size != max(fed, 0) * layers * top_k or len(s.logprobs) != len(s.tokens):
            raise DataError(f"group {group.group_id}: a sample of {len(s.tokens)} tokens has {len(s.logprobs)} "
                            f"log-probs and {routing.size} routing ids (expected {fed}x{layers}x{top_k}); "
                            "the rollout worker wrote a malformed group")
        # the proto stores routing as [layers, fed, top_k]; tokens come first here so CP sharding can index them
        routing = routing.reshape(layers, max(fed, 0), top_k).transpose(1, 0, 2).copy()
        out.append(RLSample(tokens, len(prompt), np.array(s.logprobs, dtype=np.float32), routing, float(s.reward),
                            float(a)))
    return out


class TrajectoryLog:
    """Read-only view of the stream plus trimming; finds its key in the registry until it is known."""

    def __init__(self, url: str, key: str = "", registry=None):
        self.client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=10)
        self.key, self.registry = key, registry

    def _resolve(self) -> bool:
        if not self.key and self.registry is not None:
            records = [r for r in self.registry.lookup("rollout") if r.get("stream")]
            self.key = records[0]["stream"] if records else ""
        return bool(self.key)

    def read_after(self, after: str, count: int) -> list[tuple[str, bytes]]:
        """Up to `count` entries with ids after `after`, oldest first; never blocks."""
        if not self._resolve():
            return []
        reply = self.client.xread({self.key: after}, count=count)
        return [(i.decode(), f[b"group"]) for _, entries in reply or [] for i, f in entries]

    def trim_through(self, entry_id: str) -> None:
        if entry_id == START or not self._resolve():
            return
        ms, seq = entry_id.split("-")
        self.client.xtrim(self.key, minid=f"{ms}-{int(seq) + 1}", approximate=False)


@dataclass
class _Window:
    after: str  # id of the entry before the window's first
    first: str
    bins: list[list[RLSample]]


class RolloutSequences(BaseNode[list[RLSample]]):
    """Packed sequences of samples from the stream. State: {"after", "first", "emitted"}. `next` never blocks: callers ask
    `available()` first; a position whose entries are gone (trimmed) raises DataError."""

    def __init__(self, log: TrajectoryLog, seq_len: int, groups_per_window: int, seed: int, std_normalize: bool,
                 layers: int, top_k: int):
        super().__init__()
        self.log, self.seq_len, self.groups_per_window, self.seed = log, seq_len, max(1, groups_per_window), seed
        self.std_normalize, self.layers, self.top_k = std_normalize, layers, top_k
        self.used_positions = self.total_positions = self.dropped_too_long = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        st = initial_state or {"after": START, "first": "", "emitted": 0}
        self._windows: list[_Window] = []
        self._pending: list[tuple[str, bytes]] = []
        self._pending_after = self._read_to = str(st["after"])
        self._expect_first = str(st["first"])
        self._emitted = int(st["emitted"])

    def _pull(self) -> None:
        while True:
            entries = self.log.read_after(self._read_to, self.groups_per_window - len(self._pending))
            if not entries:
                return
            if self._expect_first and entries[0][0] != self._expect_first:
                raise DataError(f"the rollout stream {self.log.key!r} no longer holds entry {self._expect_first} of the "
                                f"saved position (found {entries[0][0]} next): those trajectories were trimmed once "
                                "every rank had passed them; resume from a later state")
            self._expect_first = ""
            self._pending += entries
            self._read_to = entries[-1][0]
            if len(self._pending) == self.groups_per_window:
                self._windows.append(_Window(self._pending_after, self._pending[0][0], self._pack(self._pending)))
                self._pending_after, self._pending = self._read_to, []

    def _pack(self, entries: list[tuple[str, bytes]]) -> list[list[RLSample]]:
        samples = []
        for _, data in entries:
            group = rollout_pb2.TrajectoryGroup()
            group.ParseFromString(data)
            for s in group_samples(group, self.std_normalize, self.layers, self.top_k):
                if s.positions > self.seq_len:
                    self.dropped_too_long += 1
                elif s.positions > 0:
                    samples.append(s)
        bins = best_fit_decreasing(samples, self.seq_len)
        ms, seq = (int(x) for x in entries[0][0].split("-"))
        order = np.random.default_rng((self.seed, ms, seq)).permutation(len(bins))
        return [bins[i] for i in order]

    def available(self) -> int:
        self._pull()
        return sum(len(w.bins) for w in self._windows) - self._emitted

    def next(self) -> list[RLSample]:
        while not self._windows or self._emitted >= len(self._windows[0].bins):
            if self._windows:
                self._windows.pop(0)
                self._emitted = 0
                continue
            self._pull()
            if not self._windows:
                raise DataError(f"no complete window of trajectory groups after entry {self._pending_after} in the "
                                f"rollout stream {self.log.key!r} (trimmed, or not generated yet)")
        seq = self._windows[0].bins[self._emitted]
        self._emitted += 1
        self.used_positions += sum(s.positions for s in seq)
        self.total_positions += self.seq_len
        return seq

    def get_state(self) -> dict[str, Any]:
        if self._windows:
            return {"after": self._windows[0].after, "first": self._windows[0].first, "emitted": self._emitted}
        first = self._pending[0][0] if self._pending else self._expect_first
        return {"after": self._pending_after, "first": first, "emitted": self._emitted}

    @property
    def efficiency(self) -> float:
        return self.used_positions / self.total_positions if self.total_positions else 0.0


def build_rl_micro_batch(sequences: list[list[RLSample]], seq_len: int, pad_id: int, layers: int,
                         top_k: int) -> MicroBatch:
    """The contract's tensors plus the RL ones of the module docstring, T = len(sequences) * seq_len."""
    total = len(sequences) * seq_len
    tokens = np.full(total, pad_id, dtype=np.int64)
    labels = np.full(total, -100, dtype=np.int64)
    positions = np.zeros(total, dtype=np.int64)
    mask = np.zeros(total, dtype=bool)
    logprobs, advantages, rewards = (np.zeros(total, dtype=np.float32) for _ in range(3))
    routing = np.full((total, layers, top_k), -1, dtype=np.int32)
    cu, real = [0], 0
    for b, seq in enumerate(sequences):
        at, end = b * seq_len, (b + 1) * seq_len
        for s in seq:
            n, p = s.positions, s.prompt_len
            tokens[at:at + n] = s.tokens[:-1]
            positions[at:at + n] = np.arange(n)
            routing[at:at + n] = s.routing
            # position i predicts token i+1: completion token j (document token p+j) is predicted at i = p+j-1
            first = max(p - 1, 0)
            acts = slice(at + first, at + n)
            labels[acts] = s.tokens[first + 1:]
            mask[acts] = True
            logprobs[acts] = s.logprobs[first + 1 - p:]
            advantages[acts] = s.advantage
            rewards[acts] = s.reward
            at += n
            cu.append(at)
        real += at - b * seq_len
        if at < end:
            positions[at:end] = np.arange(end - at)
            cu.append(end)
    tensors = {"tokens": torch.from_numpy(tokens), "labels": torch.from_numpy(labels),
               "position_ids": torch.from_numpy(positions), "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
               "loss_mask": torch.from_numpy(mask), "rollout_logprobs": torch.from_numpy(logprobs),
               "advantages": torch.from_numpy(advantages), "rewards": torch.from_numpy(rewards),
               "routing_ids": torch.from_numpy(routing)}
    return MicroBatch(tensors, cp_size=1, real_tokens=real)


class RolloutStepStream(StepStream):
    """Steps of packed trajectories; the same step shape, state and CP sizing as the corpus stream."""

    def __init__(self, log: TrajectoryLog, cfg, dp_size: int, cp_sizes: list[int] | None, pad_id: int):
        self.log, self.rl, self.pad_id = log, cfg.rl, pad_id
        self.layers, self.top_k = cfg.model.num_layers - cfg.model.first_k_dense, cfg.model.top_k
        super().__init__([], cfg.data, dp_size, cp_sizes)

    def _sequences(self) -> RolloutSequences:
        self._sources = []
        return RolloutSequences(self.log, self.cfg.seq_len, self.cfg.packing_window // max(1, self.rl.group_size),
                                self.cfg.seed, self.rl.std_normalize, self.layers, self.top_k)

    def identity(self) -> dict[str, Any]:
        return {"dataset": f"rollout:{self.log.key or '(registry)'}", "blend_weights": [], "seq_len": self.cfg.seq_len,
                "packing_window": self.cfg.packing_window, "seed": self.cfg.seed}

    def check(self, state: dict[str, Any]) -> None:
        self.log._resolve()  # the key is part of the identity once it is known
        super().check(state)

    def build(self, sequences) -> MicroBatch:
        return build_rl_micro_batch(sequences, self.cfg.seq_len, self.pad_id, self.layers, self.top_k)

    def ready(self) -> bool:
        return self.sequences.available() >= self.dp_size * self.cfg.grad_accum * self.cfg.micro_batch_size

    def release(self, state: dict[str, Any]) -> None:
        self.log.trim_through(str(state["after"]))

    @property
    def epoch(self) -> int:
        return 0

