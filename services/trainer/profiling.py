"""`run.profile_steps=[first, last]`: record those training steps with torch.profiler and write a Chrome trace per rank.

The trace (`<run.dir>/profile/trace_rank<r>.json`; open it in https://ui.perfetto.dev or chrome://tracing) holds the
host's calls and the device's kernels and copies on every stream, with each step and each checkpoint save marked as a
host range ("step N", "checkpoint save"). Rank 0 also prints the operators with the most device time.

Steps are numbered as the trainer prints them (1-based). The trainer normally queues step k+1 before it waits for step k
(services/trainer/train.py); recording starts before step `first` is queued, and after step `last` is queued the
profiler waits for the training stream to finish it, so the trace holds exactly those steps' work (and the copies of
the saves they made, as far as they got). That one wait is the only change to how the run executes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function


class StepProfiler:
    def __init__(self, steps: list[int], out_dir: str | Path, rank: int, device: torch.device):
        self.first, self.last = (steps[0], steps[1]) if steps else (0, -1)
        self.path = Path(out_dir) / f"trace_rank{rank}.json"
        self.rank, self.device = rank, device
        self._prof: profile | None = None
        self._range: record_function | None = None

    def begin(self, number: int) -> None:
        """Before queuing step `number` (1-based): starts recording at `first`, and marks the step while recording."""
        if number == self.first:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._prof = profile(activities=activities)
            self._prof.start()
        if self._prof is not None:
            self._range = record_function(f"step {number}")
            self._range.__enter__()

    def end(self, number: int) -> None:
        """After queuing step `number` (and its save); at `last`, waits for the training stream, stops and writes the trace."""
        if self._prof is None:
            return
        self._range.__exit__(None, None, None)
        if number < self.last:
            return
        prof, self._prof = self._prof, None
        if self.device.type == "cuda":  # the training stream only: a checkpoint may still be copying on its own
            torch.cuda.current_stream(self.device).synchronize()
        prof.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        if self.rank == 0:
            key = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            print(f"trainer: profile of steps {self.first}-{self.last} written to {self.path}", flush=True)
            print(prof.key_averages().table(sort_by=key, row_limit=15), flush=True)

    def close(self) -> None:
        """A run that ends (or fails) before `last`: stop recording without writing a trace."""
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
