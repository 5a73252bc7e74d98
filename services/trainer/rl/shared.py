"""Every trainer rank gets each step's trajectory groups; only rank 0 reads the rollout stream.

The stream has exactly one consumer, which deletes what it reads (`rollouts.RolloutReader`), so under data parallelism
rank 0 alone holds the reader: it reads the step's groups (staleness filter included) and broadcasts them to every rank
as their wire bytes, the `proto/rollout.proto` TrajectoryGroup messages the workers wrote (no pickling): one int64
header [status, payload bytes, dropped_stale, dropped_foreign, one length per group], then one uint8 payload. Every
rank decodes every group.

Broadcast rather than scatter: with the whole step on every rank, the per-group numbers of the step (reward mean and
std, response length, policy versions, staleness) are the same local computation everywhere, with no collective; only
the token sums of the loss terms need one (`step.py`). The price is N copies of bytes that are small next to the
step's compute.

Each data-parallel replica then trains on its `share`: groups i with i % dp == dp_rank (round robin). It is a pure
function of the step's list, so every rank agrees on it without talking, and replicas differ by at most one group.
A group's advantages depend on its own samples only, so sharding whole groups leaves them unchanged.

When rank 0 cannot read (no trajectories within `rl.rollout_timeout_s`, Redis gone), it still broadcasts a header, with
a failure status, before raising: the other ranks raise too instead of hanging in the broadcast.
"""

from __future__ import annotations

from typing import Any, Sequence, TypeVar

import torch
import torch.distributed as dist

from services.trainer.rl.rollouts import RolloutGroup, RolloutReader, decode_group

T = TypeVar("T")

_OK, _TIMEOUT, _FAILED = 1, 0, -1
_HEADER = 4  # status, payload bytes, dropped_stale, dropped_foreign; then one length per group


def share(items: Sequence[T], dp_rank: int, dp_size: int) -> list[T]:
    """This replica's part of the step: items i with i % dp_size == dp_rank."""
    return list(items[dp_rank::dp_size])


class SharedRollouts:
    """The rollout stream as every rank sees it. `reader` on rank 0 (None on the others); one rank: the reader itself.

    Same interface as the reader for the training loop and the checkpoint (`next_groups`, `state`, `resume`, the
    dropped counters, which every rank receives with each step's groups)."""

    def __init__(self, reader: RolloutReader | None, device: torch.device):
        live = dist.is_available() and dist.is_initialized()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if live else (0, 1)
        if (reader is None) != (self.rank != 0):
            raise ValueError(f"rank {self.rank}: exactly rank 0 holds the rollout reader")
        self.reader, self.device = reader, device
        self.stream = reader.stream if reader is not None else None
        self.dropped_stale = self.dropped_foreign = 0

    def next_groups(self, count: int, trainer_version: int, timeout_s: float = 300.0) -> list[RolloutGroup]:
        """The step's `count` groups, the same list on every rank (blocks until rank 0 has read them)."""
        if self.world == 1:
            groups = self.reader.next_groups(count, trainer_version, timeout_s=timeout_s)
            self.dropped_stale, self.dropped_foreign = self.reader.dropped_stale, self.reader.dropped_foreign
            return groups
        header = torch.zeros(_HEADER + count, dtype=torch.int64)
        groups, error = None, None
        if self.rank == 0:
            try:
                groups = self.reader.next_groups(count, trainer_version, timeout_s=timeout_s)
                lengths = [len(g.wire) for g in groups]
                header[:_HEADER] = torch.tensor([_OK, sum(lengths), self.reader.dropped_stale,
                                                 self.reader.dropped_foreign])
                header[_HEADER:] = torch.tensor(lengths, dtype=torch.int64)
            except Exception as e:  # every rank must leave the broadcast; rank 0 re-raises below
                header[0], error = (_TIMEOUT if isinstance(e, TimeoutError) else _FAILED), e
        header = header.to(self.device)
        dist.broadcast(header, src=0)
        header = header.cpu()
        status, total, stale, foreign = header[:_HEADER].tolist()
        if status != _OK:
            if error is not None:
                raise error
            what = "no trajectories arrived in time" if status == _TIMEOUT else "reading the rollout stream failed"
            raise (TimeoutError if status == _TIMEOUT else RuntimeError)(
                f"trainer rank {self.rank}: rank 0 could not read step {trainer_version}'s trajectory groups "
                f"({what}; rank 0's error says why)")
        self.dropped_stale, self.dropped_foreign = stale, foreign
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(b"".join(g.wire for g in groups)), dtype=torch.uint8)
            payload = payload.to(self.device)
        else:
            payload = torch.empty(total, dtype=torch.uint8, device=self.device)
        dist.broadcast(payload, src=0)
        if self.rank == 0:
            return groups
        data, out, at = payload.cpu().numpy().tobytes(), [], 0
        for n in header[_HEADER:].tolist():
            out.append(decode_group(data[at:at + n]))
            at += n
        return out

    def discard_backlog(self) -> int:
        return self.reader.discard_backlog() if self.reader is not None else 0

    def state(self) -> dict[str, Any]:
        """The data state a checkpoint keeps (rank 0's is the one read back: `Checkpoint.extra`)."""
        return {"source": "rollout_stream", "stream": self.stream, "dropped_stale": self.dropped_stale,
                "dropped_foreign": self.dropped_foreign}

    def resume(self, state: dict[str, Any]) -> None:
        if self.reader is not None:
            self.reader.resume(state)  # checks the checkpoint is an RL run's
        elif state.get("source") != "rollout_stream":
            raise ValueError(f"the checkpoint's data state is from a {state.get('source', 'corpus')!r} source, not "
                             "an RL run's rollout stream")
        self.dropped_stale = int(state.get("dropped_stale", 0))
        self.dropped_foreign = int(state.get("dropped_foreign", 0))

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
