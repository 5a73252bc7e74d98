"""Rank 0's console output: one line per step with a progress bar, and one per evaluation of the held-out loss (works
the same in a terminal and in a log file)."""

from __future__ import annotations

import math
import time

import torch
from rich.console import Console

from services.common.config import Config


class StepPrinter:
    def __init__(self, total_steps: int, start_step: int, enabled: bool):
        self.total, self.start, self.enabled = total_steps, start_step, enabled
        self.console = Console(highlight=False, soft_wrap=True)
        self.t0 = time.perf_counter()

    def _bar(self, step: int, width: int = 20) -> str:
        filled = int(width * step / self.total)
        return "█" * filled + "░" * (width - filled)

    def header(self, cfg: Config, device: torch.device, peak_sheet: float, peak_measured: float, start_step: int) -> None:
        if not self.enabled:
            return
        where = f"resuming at step {start_step}" if start_step else "from scratch"
        peaks = f"peak {peak_sheet:.0f} TFLOP/s (datasheet), {peak_measured:.1f} measured" if peak_sheet else \
            f"peak {peak_measured:.2f} TFLOP/s measured"
        self.console.print(f"trainer: {cfg.run.name} on {device}, {cfg.run.steps} steps {where}; {peaks}")

    def step(self, r: dict) -> None:
        if not self.enabled:
            return
        step = r["step"]
        done = step - self.start
        eta = (time.perf_counter() - self.t0) / max(done, 1) * (self.total - step)
        mfu = f" mfu {100 * r['mfu']:.1f}%" if r.get("mfu") else (
            f" mfu* {100 * r['mfu_measured_peak']:.1f}%" if r.get("mfu_measured_peak") else "")
        self.console.print(
            f"step {step:>5}/{self.total} {self._bar(step)} loss {r['loss']:.4f} gnorm {r['grad_norm']:.2f} "
            f"lr {r['lr']:.2e} {r['tokens_per_s']:,.0f} tok/s{mfu} load×{r['max_load_ratio']:.2f} "
            f"drop {100 * r['dropped_frac']:.1f}% wait {1000 * r['data_wait_s']:.0f}ms eta {eta:.0f}s")
        if "eval_loss" in r:
            self.console.print(f"eval {step:>5}/{self.total} held-out loss {r['eval_loss']:.4f} "
                               f"ppl {math.exp(min(r['eval_loss'], 80)):.2f} over {r['eval_tokens']:,} tokens "
                               f"({r['eval_time_s']:.1f}s)")

    def done(self) -> None:
        if self.enabled:
            self.console.print(f"trainer: done in {time.perf_counter() - self.t0:.1f}s")
