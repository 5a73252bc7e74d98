"""Next-token sampling for a batch of rows, each with its own temperature / top-k / top-p.

The log-prob recorded for a sampled token is taken under the temperature-scaled distribution *before* top-k/top-p
truncation: that is the density the trainer can recompute from logits alone (it divides by the same temperature), so the
train/rollout importance ratio compares like with like. Truncation only decides which tokens may be drawn.

Without truncation (top_k 0, top_p 1: the RL default) a batch is sampled by two kernels that read its logits about
once (kernels/sample.py); with it, through a sort of each row's vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.sample import sample_categorical


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
    def truncates(self) -> bool:
        """True when top-k or top-p limits which tokens may be drawn."""
        return self.top_k > 0 or self.top_p < 1

    @property
    def row(self) -> tuple[float, float, float]:
        """(temperature, top_k, top_p): this request's column of the parameters `sample` takes."""
        return self.temperature, self.top_k, self.top_p


def sample(logits: torch.Tensor, params: torch.Tensor, truncate: bool,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V], params [3, B] fp32 (temperature, top_k, top_p: each row's `SamplingParams.row`, on the logits'
    device) -> (tokens [B] int64, log-probs [B] fp32 of those tokens). `truncate`: whether any row truncates
    (`SamplingParams.truncates`), known to the caller on the host, so that choosing the path never waits for the
    device."""
    temp, top_k, top_p = params
    if not truncate:
        # No truncation: the logits read about once (kernels/sample.py), seeded from `generator` on the device.
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=logits.device, generator=generator)
        return sample_categorical(logits, temp, seed)
    logits = logits.float()
    greedy = temp <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temp), temp)[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    drawn = _draw_top_k_top_p(scaled, top_k.long(), top_p, generator)
    tokens = torch.where(greedy, logits.argmax(dim=-1), drawn)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def _draw_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from the temperature-scaled logits, restricted to each row's top-k and top-p nucleus."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[1], device=scaled.device)[None, :]
    drop = (top_k[:, None] > 0) & (ranks >= top_k[:, None])
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # A token is dropped when the tokens ranked above it already reach top_p; the most likely token always stays.
    drop |= (top_p[:, None] < 1) & ((probs.cumsum(-1) - probs) >= top_p[:, None])
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    return order.gather(1, torch.multinomial(probs, 1, generator=generator)).squeeze(1)
