"""Blending several datasets: each packed sequence comes from one dataset, picked by weight.

The pick for the n-th sequence is a pure function of (seed, n), drawn in blocks, so the state is just the count of
sequences handed out plus each dataset's own packing state: small, JSON, exact. (torchdata's MultiNodeWeightedSampler
does the same job but keeps a torch generator state, kilobytes of bytes per checkpoint, in its state.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from services.dataloader.packing import PackedSequences, Sequence

_BLOCK = 1024
_BLEND_STREAM = 0x5EED  # keeps the blend's draws apart from the datasets' shuffles that share `seed`


class BlendedSequences(BaseNode[Sequence]):
    """State: {"yielded": n, "sources": [state of each dataset's PackedSequences]}."""

    def __init__(self, sources: list[PackedSequences], weights: list[float], seed: int):
        super().__init__()
        if len(sources) != len(weights) or not sources or min(weights) <= 0:
            raise ValueError(f"need one positive weight per dataset, got {weights} for {len(sources)} datasets")
        self.sources, self.seed = sources, seed
        self.probs = np.asarray(weights, dtype=np.float64) / float(sum(weights))
        self._block_index = -1

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self._yielded = 0
            for s in self.sources:
                s.reset(None)
        else:
            self._yielded = int(initial_state["yielded"])
            for s, st in zip(self.sources, initial_state["sources"], strict=True):
                s.reset(st)

    def _pick(self, n: int) -> int:
        block = n // _BLOCK
        if block != self._block_index:
            rng = np.random.default_rng((self.seed, _BLEND_STREAM, block))
            self._block = rng.choice(len(self.sources), size=_BLOCK, p=self.probs)
            self._block_index = block
        return int(self._block[n % _BLOCK])

    def next(self) -> Sequence:
        seq = next(self.sources[self._pick(self._yielded)])
        self._yielded += 1
        return seq

    def get_state(self) -> dict[str, Any]:
        return {"yielded": self._yielded, "sources": [s.state_dict() for s in self.sources]}

    @property
    def used_positions(self) -> int:
        return sum(s.used_positions for s in self.sources)

    @property
    def total_positions(self) -> int:
        return sum(s.total_positions for s in self.sources)

    @property
    def efficiency(self) -> float:
        return self.used_positions / self.total_positions if self.total_positions else 0.0
