"""What the server sends to whom: step buffer, per-rank cursors and credits, resume. No sockets here.

Invariants:
- Steps are produced in order, only on demand, and at most `max_buffered` are held.
- A step is dropped only when every expected rank (group_size per dp rank served) has joined since the last reset and
  moved past it, so a slow peer always finds its step.
- A rank receives at most as many micro-batches as it has granted credits.
- A resume to a position of the stream the joined ranks are on is served without disturbing them: the position the
  stream already holds (every rank resuming from the same checkpoint) is a no-op, and a position a few steps before or
  after it (ranks that rejoin a restarted service each from the last step they fully received stand up to a step apart)
  is checked by replaying the packing between the two, then the production point moves back if needed. Any other
  resume rebuilds the stream there and starts a new generation, and ranks of an older generation are not served, so no
  rank can mix micro-batches of two streams.
- Replicas (`data.replicas` > 1): replica r of n serves only the dp ranks with dp_rank % n == r. Every replica packs
  the same global stream (same steps, same states, same CP sizing), builds only its own ranks' micro-batches and
  counts only its own ranks as expected, so the union of the replicas sends what one service would.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from proto import dataloader_pb2 as pb
from services.common.config import MAX_PREFETCH
from services.dataloader.dataset import IndexedDataset
from services.dataloader.errors import DataError
from services.dataloader.heldout import eval_sequences
from services.dataloader.stream import Step, StepStream, build_micro_batch

# How far apart (in steps) two resume positions may be and still be checked for lying on one stream; farther: reset.
MAX_REALIGN_STEPS = 64


@dataclass
class Client:
    ident: bytes
    rank: int
    dp_rank: int
    group_size: int
    step: int
    micro: int
    credits: int
    generation: int


class Engine:
    def __init__(self, datasets: list[IndexedDataset], data_cfg, cp_sizes: list[int] | None = None,
                 max_buffered: int | None = None, make_stream: Callable[[int], StepStream] | None = None,
                 replica: int = 0, eval_datasets: list[IndexedDataset] | None = None):
        """`make_stream(dp_size)`: the step stream to serve; default: packed documents of `datasets`.
        `replica`: this service's index among the run's `data_cfg.replicas` (see the module docstring).
        `eval_datasets`: `data.eval_corpus`'s, which the evaluation set packs instead of held-out documents."""
        self.datasets, self.cfg, self.cp_sizes = datasets, data_cfg, list(cp_sizes or [1])
        self.replica, self.replicas = replica, data_cfg.replicas
        if not 0 <= replica < self.replicas:
            raise DataError(f"replica {replica} is outside [0, data.replicas={self.replicas})")
        self.make_stream = make_stream or (lambda dp_size: StepStream(datasets, data_cfg, dp_size, self.cp_sizes))
        self.make_stream(1)  # a config the stream cannot serve fails at start, not at a join
        # The evaluation set (heldout.py), built at start for the same reason; None: the run evaluates nothing
        held = eval_datasets or (datasets if data_cfg.eval_fraction else None)
        self.eval_set = [build_micro_batch(held, seqs, data_cfg.seq_len)
                         for seqs in eval_sequences(held, data_cfg, whole=bool(eval_datasets))] if held else None
        self.max_buffered = max_buffered or max(2, -(-data_cfg.prefetch // data_cfg.grad_accum) + 1)
        self.lock = threading.Lock()
        self.stream: StepStream | None = None
        self.steps: dict[int, Step] = {}
        self.clients: dict[int, Client] = {}  # by global rank
        self.generation = 0
        self.dp_size = 0
        self.joinable = 0  # highest step a rank may join at: the production point, or beyond it after a checked resume
        self._scratch: StepStream | None = None  # replays packing to check that two positions lie on one stream
        self._served: dict[int, dict[str, Any]] = {}  # step -> node state before it, for steps dropped recently
        self.sent = 0  # statistics since start, for Status and the metrics exporter
        self.tokens_sent = 0
        self.steps_produced = 0
        self.steps_served = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=4096)

    # ------------------------------------------------------------ control

    def serves(self, dp_rank: int) -> bool:
        return dp_rank % self.replicas == self.replica

    def _new_stream(self, dp_size: int, state: dict[str, Any] | None) -> None:
        self.stream = self.make_stream(dp_size)
        self.stream.dp_ranks = {r for r in range(dp_size) if self.serves(r)}
        self._scratch = None
        self.dp_size = dp_size
        self._new_generation(state)

    def _new_generation(self, state: dict[str, Any] | None) -> None:
        self.steps.clear()
        self._served.clear()
        self.generation += 1
        self.stream.reset(state)
        self.joinable = self.stream.step

    def resume(self, state_json: str, dp_size: int) -> tuple[int, bool]:
        """Position the stream at a saved state ("" or "{}": the start). Returns (start step, whether it was rebuilt)."""
        try:
            state = json.loads(state_json) if state_json else None
        except json.JSONDecodeError as e:
            raise DataError(f"dataloader state is not JSON ({e})") from None
        state = state or None
        if dp_size < 1:
            raise DataError(f"dp_size must be positive, got {dp_size}")
        if self.stream is None or self.stream.dp_size != dp_size:
            self._new_stream(dp_size, state)
            return self.stream.step, True
        if state is None:
            step, node_state = 0, self.stream.initial_node_state
        else:
            self.stream.check(state)
            step, node_state = int(state["step"]), state["stream"]
        held = self.steps.get(step)
        if (held is not None and held.state_before == node_state) or (
                step == self.stream.step and self.stream.node.state_dict() == node_state):
            self.joinable = max(self.joinable, step)
            return step, False
        if not self._on_this_stream(step, node_state):
            self._new_generation(state)
            return step, True
        # The joined ranks stay valid: move the production point back if the step is no longer buffered.
        self.joinable = max(self.joinable, step)
        if step < min(self.steps, default=self.stream.step):
            self.steps.clear()
            self.stream.reset(state)
            return step, True
        return step, False

    def _on_this_stream(self, step: int, node_state: dict[str, Any]) -> bool:
        """Whether `node_state` is where this stream stands at `step`: replay the packing from the earlier of it and
        the production point to the later one (sequence order only, no tensors) and compare."""
        here, here_state = self.stream.step, self.stream.node.state_dict()
        gap = step - here
        if abs(gap) > MAX_REALIGN_STEPS:
            return False
        if self._scratch is None:
            self._scratch = self.make_stream(self.dp_size)
        start, target = (here_state, node_state) if gap >= 0 else (node_state, here_state)
        try:
            self._scratch.node.reset(start)
            for _ in range(abs(gap)):
                next(self._scratch.node)
        except (KeyError, TypeError, ValueError, IndexError, DataError):
            return False  # malformed inside, or input that is gone (an RL stream trimmed past it): not this stream
        return self._scratch.node.state_dict() == target

    def hello(self, ident: bytes, msg: pb.DataHello) -> str | None:
        """Register a rank at `msg.start_step`; returns an error message for the client, or None."""
        if self.stream is None:
            self._new_stream(msg.dp_size, None)
        if msg.dp_size != self.dp_size:
            return (f"rank {msg.rank} uses dp_size={msg.dp_size} but the stream was set up for dp_size={self.dp_size}; "
                    "all ranks must agree (call ResumeFromState with the new layout first)")
        if not 0 <= msg.dp_rank < msg.dp_size:
            return f"dp_rank={msg.dp_rank} is outside [0, dp_size={msg.dp_size})"
        if not self.serves(msg.dp_rank):
            return (f"rank {msg.rank} (dp_rank {msg.dp_rank}) is not served by this dataloader: replica {self.replica} "
                    f"of data.replicas={self.replicas} serves dp ranks with dp_rank % {self.replicas} == "
                    f"{self.replica}; connect to replica {msg.dp_rank % self.replicas} (give the trainer and the "
                    "dataloaders the same data.replicas)")
        oldest, newest = min(self.steps, default=self.stream.step), max(self.stream.step, self.joinable)
        if not oldest <= msg.start_step <= newest:
            return (f"rank {msg.rank} asks for step {msg.start_step} but the stream holds steps {oldest}.."
                    f"{newest}; call ResumeFromState with the state of step {msg.start_step} first")
        self.clients[msg.rank] = Client(ident, msg.rank, msg.dp_rank, max(1, msg.group_size), msg.start_step, 0,
                                        min(msg.credits, MAX_PREFETCH), self.generation)
        return None

    def credit(self, rank: int, credits: int) -> None:
        client = self.clients.get(rank)
        if client is not None:
            client.credits = min(client.credits + credits, MAX_PREFETCH)

    def client_rank(self, ident: bytes) -> int | None:
        for c in self.clients.values():
            if c.ident == ident:
                return c.rank
        return None

    # ------------------------------------------------------------ evaluation

    def eval_share(self, dp_rank: int, dp_size: int) -> list[tuple[pb.MicroBatchHeader, dict]]:
        """Dp rank `dp_rank`'s micro-batches of the evaluation set as (header, tensors): micro-batches j = dp_rank,
        dp_rank + dp_size, ..., each sized for the largest CP size (every CP peer of the rank runs it)."""
        if self.eval_set is None:
            raise DataError("this dataloader has no evaluation set (" + (
                "it serves an RL run's rollout stream" if not self.datasets else
                "`data.eval_fraction=0` and no `data.eval_corpus`") + "); give it the trainer's config")
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        if not self.serves(dp_rank):
            raise DataError(f"dp_rank {dp_rank} is not served by replica {self.replica} of data.replicas="
                            f"{self.replicas}; ask replica {dp_rank % self.replicas}")
        if len(self.eval_set) % dp_size:
            raise DataError(f"`data.eval_micro_batches={len(self.eval_set)}` is not a multiple of the trainer's "
                            f"data-parallel size {dp_size}; make it one")
        share = self.eval_set[dp_rank::dp_size]
        return [(pb.MicroBatchHeader(micro=i, grad_accum=len(share), dp_rank=dp_rank, cp_size=max(self.cp_sizes),
                                     num_segments=mb.num_segments, real_tokens=mb.real_tokens), mb.tensors)
                for i, mb in enumerate(share)]

    # ------------------------------------------------------------ serving

    def pending(self) -> list[tuple[bytes, pb.MicroBatchHeader, dict]]:
        """Micro-batches that may be sent now, as (ident, header, tensors); advances cursors and spends credits."""
        out = []
        for c in self.clients.values():
            if c.generation != self.generation:
                continue
            while c.credits > 0:
                step = self._step(c.step)
                if step is None:
                    break
                mb = step.per_rank[c.dp_rank][c.micro]
                ga = len(step.per_rank[c.dp_rank])
                header = pb.MicroBatchHeader(step=step.index, micro=c.micro, grad_accum=ga, dp_rank=c.dp_rank,
                                             cp_size=mb.cp_size, num_segments=mb.num_segments,
                                             real_tokens=mb.real_tokens, state_after=json.dumps(step.state_after))
                out.append((c.ident, header, mb.tensors))
                c.credits -= 1
                c.micro += 1
                if c.micro == ga:
                    c.step, c.micro = c.step + 1, 0
                self.sent += 1
                self.tokens_sent += mb.real_tokens
                self._recent.append((time.monotonic(), mb.real_tokens))
        self._collect()
        return out

    def _step(self, index: int) -> Step | None:
        while index >= self.stream.step and len(self.steps) < self.max_buffered and self.stream.ready():
            step = self.stream.next_step()
            self.steps[step.index] = step
            self.steps_produced += 1
        return self.steps.get(index)

    def _current(self) -> list[Client]:
        return [c for c in self.clients.values() if c.generation == self.generation]

    def expected_clients(self) -> int:
        current = self._current()
        served = sum(1 for r in range(self.dp_size) if self.serves(r))
        return served * max((c.group_size for c in current), default=1)

    def _collect(self) -> None:
        current = self._current()
        if not current or len(current) < self.expected_clients():
            return
        low = min(c.step for c in current)
        for s in sorted(s for s in self.steps if s < low):
            self._served[s] = self.steps.pop(s).state_before
            self.steps_served += 1
        # Input is released `max_buffered` steps behind the slowest rank's cursor, not at it: the cursor counts what
        # was sent, and a rank that dies with prefetched micro-batches unread resumes from an earlier step.
        keep_from = low - self.max_buffered
        old = [s for s in self._served if s <= keep_from]
        if old:
            self.stream.release(self._served[max(old)])
            for s in old:
                del self._served[s]

    # ------------------------------------------------------------ reporting

    def get_state(self, step: int | None) -> dict[str, Any]:
        if self.stream is None:
            raise DataError("the stream is not set up yet: no rank has joined or resumed")
        if step is None:
            return self.stream.state()
        held = self.steps.get(step)
        if held is None:
            raise DataError(f"step {step} is not buffered (buffered: {sorted(self.steps)})")
        return {**self.stream.state(), "step": step, "stream": held.state_before}

    def status(self) -> pb.DataStatusReply:
        now = time.monotonic()
        recent = [(t, n) for t, n in self._recent if now - t <= 5.0]
        span = max(now - recent[0][0], 1e-3) if len(recent) > 1 else 0.0
        current = self._current()
        s = self.stream
        return pb.DataStatusReply(
            next_step=s.step if s else 0, oldest_step=min(self.steps, default=s.step if s else 0),
            buffered_steps=len(self.steps), clients=len(current), expected_clients=self.expected_clients(),
            credits_outstanding=sum(c.credits for c in current),
            efficiency=s.efficiency if s else 0.0, micro_batches_sent=self.sent,
            micro_batches_per_s=(len(recent) / span) if span else 0.0,
            tokens_per_s=(sum(n for _, n in recent) / span) if span else 0.0,
            epoch=s.epoch if s else 0,
            dataset=s.identity()["dataset"] if s else "")
