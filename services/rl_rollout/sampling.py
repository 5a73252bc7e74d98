"""Next-token sampling for a batch of rows, each with its own temperature / top-k / top-p.

The log-prob recorded for a sampled token is taken under the temperature-scaled distribution *before* top-k/top-p
truncation: that is the density the trainer can recompute from logits alone (it divides by the same temperature), so the
train/rollout importance ratio compares like with like. Truncation only decides which tokens may be drawn.

A batch is sampled by two kernels that read its logits about once (kernels/sample.py). With truncation (top-k, top-p;
off by default in RL) a search finds each row's floor first (kernels/truncation.py: a few passes over the logits, no
sort): the tokens at or above it may be drawn, ties at the boundary all kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from kernels.sample import sample_categorical
from kernels.truncation import truncation_floor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy (argmax); log-probs are then those of the unscaled logits
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p (1: off)
    top_k: int = 0  # keep the k most likely tokens (0: off)
    max_tokens: int = 16  # completion length limit
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop once the completion text contains one of these
    stop_at_eos: bool = True

    def __post_init__(self):
        # A run's rl.* values are refused at config load, naming the key (config.py `_check_rollout`); this guards
        # the callers that build parameters themselves (bench/bench_rollout.py, tests).
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.max_tokens < 1:
            raise ValueError(f"need top_k >= 0 and max_tokens >= 1, got top_k={self.top_k}, max_tokens={self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError(f"an empty stop string would end every completion at its first token (stop={self.stop!r})")


    @property
    def row(self) -> tuple[float, float, float]:
        """(temperature, top_k, top_p): this request's column of the parameters `sample` takes."""
        return self.temperature, self.top_k, self.top_p


def truncation_of(params: Iterable[SamplingParams]) -> tuple[bool, bool]:
    """(any by top-k, any by top-p) over the requests: `sample`'s `truncation`."""
    by_k = by_p = False
    for p in params:
        by_k, by_p = by_k or p.top_k > 0, by_p or p.top_p < 1
    return by_k, by_p


def sample(logits: torch.Tensor, params: torch.Tensor, truncation: tuple[bool, bool] = (False, False),
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V], params [3, B] fp32 (temperature, top_k, top_p: each row's `SamplingParams.row`, on the logits'
    device) -> (tokens [B] int64, log-probs [B] fp32 of those tokens). `truncation`: whether any row truncates by
    top-k, and whether any by top-p (`truncation_of` the rows' requests), known to the caller on the
    host, so that choosing the path never waits for the device. Seeded from `generator` on the device."""
    temp, top_k, top_p = params
    use_top_k, use_top_p = truncation
    floor = truncation_floor(logits, temp, top_k, top_p, use_top_k, use_top_p) if use_top_k or use_top_p else None
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=logits.device, generator=generator)
    return sample_categorical(logits, temp, seed, floor)
