"""Charts of a run from the trainer's per-step records (`run.metrics_file`, JSON lines): `foldmoe plot`.

    loss.png         loss and gradient norm per step (and the held-out loss where the run evaluated)
    throughput.png   tokens/s per step, with MFU where the record has it
    expert_load.png  each expert's share of the routed tokens per step (a heatmap: rows experts, columns steps)

The metrics file is appended to by every run with the same `run.metrics_file`, so a resumed run adds its steps and a
restarted-from-scratch run repeats some: the newest record of each step wins.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit
import matplotlib.pyplot as plt  # noqa: E402


class PlotError(ValueError):
    """The metrics file is missing or holds no step records."""


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """One record per step, in step order (the last one written for a step wins)."""
    path = Path(path)
    if not path.is_file():
        raise PlotError(f"no metrics file at {path}; train first (`foldmoe train`) or pass --metrics FILE")
    by_step: dict[int, dict[str, Any]] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            by_step[int(record["step"])] = record
        except (ValueError, KeyError, TypeError):
            raise PlotError(f"{path}:{n} is not a step record (JSON with a `step`): {line[:80]!r}") from None
    if not by_step:
        raise PlotError(f"{path} holds no step records yet")
    return [by_step[s] for s in sorted(by_step)]


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(r["step"])
            values.append(float(v))
    return steps, values


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_loss(records: list[dict[str, Any]], path: Path) -> Path:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(*_series(records, "loss"), lw=1, label="training")
    steps, held_out = _series(records, "eval_loss")
    if steps:
        top.plot(steps, held_out, "o-", ms=3, lw=1, color="tab:red", label="held out")
        top.legend()
    top.set_ylabel("loss")
    top.grid(alpha=0.3)
    bottom.plot(*_series(records, "grad_norm"), lw=1, color="tab:orange")
    bottom.set_ylabel("grad norm")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    return _save(fig, path)


def plot_throughput(records: list[dict[str, Any]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(*_series(records, "tokens_per_s"), lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    steps, mfu = _series(records, "mfu")
    if not steps:  # no datasheet peak (CPU): the peak measured in the run is the denominator
        steps, mfu = _series(records, "mfu_measured_peak")
    if steps:
        twin = ax.twinx()
        twin.plot(steps, [100 * m for m in mfu], lw=1, color="tab:green")
        twin.set_ylabel("MFU %", color="tab:green")
    return _save(fig, path)


def plot_expert_load(records: list[dict[str, Any]], path: Path) -> Path:
    rows = [(r["step"], r["expert_load"]) for r in records if r.get("expert_load")]
    if not rows:
        raise PlotError("no record has an `expert_load` (a dense model has none)")
    experts = max(len(load) for _, load in rows)
    # Share of the step's routed tokens, so steps with different token counts compare; a balanced router is 1/E.
    grid = [[0.0] * len(rows) for _ in range(experts)]
    for col, (_, load) in enumerate(rows):
        total = sum(load) or 1.0
        for e, v in enumerate(load):
            grid[e][col] = v / total
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.25 * experts + 1.5)))
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis", origin="lower",
                      extent=(rows[0][0] - 0.5, rows[-1][0] + 0.5, -0.5, experts - 0.5))
    fig.colorbar(image, ax=ax, label=f"share of routed tokens (balanced: {1 / experts:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("expert")
    return _save(fig, path)


def plot_run(metrics_file: str | Path, out_dir: str | Path) -> list[Path]:
    """Writes the charts into `out_dir`; returns their paths (no expert chart for a run without expert loads)."""
    records = read_records(metrics_file)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [plot_loss(records, out / "loss.png"), plot_throughput(records, out / "throughput.png")]
    if any(r.get("expert_load") for r in records):
        paths.append(plot_expert_load(records, out / "expert_load.png"))
    return paths
