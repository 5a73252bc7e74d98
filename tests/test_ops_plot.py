"""`foldmoe plot` turns a run's step records (the trainer's JSONL metrics file) into PNG charts: loss, throughput and
an expert-load heatmap; the newest record of a repeated step wins; a missing or malformed file is one clear error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.plot import PlotError, plot_run, read_records

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_records(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def record(step: int, loss: float = 3.0, experts: int = 4) -> dict:
    return {"step": step, "loss": loss, "grad_norm": 1.0, "tokens_per_s": 1000.0 + step, "mfu": None,
            "mfu_measured_peak": 0.1, "expert_load": [float(step + e) for e in range(experts)]}


def test_plot_writes_loss_throughput_and_expert_load_pngs(tmp_path):
    metrics = write_records(tmp_path / "m.jsonl", [record(s, 5.0 - 0.1 * s) for s in range(1, 21)])
    res = subprocess.run([sys.executable, "-m", "services.cli", "plot", "--metrics", str(metrics),
                          "--out", str(tmp_path / "plots")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    paths = [Path(line) for line in res.stdout.split()]
    assert [p.name for p in paths] == ["loss.png", "throughput.png", "expert_load.png"]
    for p in paths:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000, p


def test_a_run_without_expert_loads_gets_no_heatmap(tmp_path):
    metrics = write_records(tmp_path / "m.jsonl", [{**record(s), "expert_load": []} for s in range(1, 4)])
    assert [p.name for p in plot_run(metrics, tmp_path / "plots")] == ["loss.png", "throughput.png"]


def test_the_newest_record_of_a_repeated_step_wins(tmp_path):
    # A run restarted from scratch appends steps 1.. again to the same file.
    metrics = write_records(tmp_path / "m.jsonl", [record(1, 9.0), record(2, 9.0), record(1, 1.0), record(2, 2.0)])
    assert [(r["step"], r["loss"]) for r in read_records(metrics)] == [(1, 1.0), (2, 2.0)]


def test_missing_and_malformed_metrics_files_are_named(tmp_path):
    with pytest.raises(PlotError, match="no metrics file at .*train first"):
        read_records(tmp_path / "absent.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(record(1)) + "\nnot json\n")
    with pytest.raises(PlotError, match=r"bad.jsonl:2 is not a step record"):
        read_records(bad)


def test_plot_command_reports_a_missing_file_as_one_line(tmp_path):
    res = subprocess.run([sys.executable, "-m", "services.cli", "plot", f"run.metrics_file={tmp_path / 'none.jsonl'}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"foldmoe: error: no metrics file at {tmp_path / 'none.jsonl'}; train first (`foldmoe train`) or pass "
        "--metrics FILE"]


def test_the_loss_chart_draws_the_held_out_loss_where_the_run_evaluated(tmp_path, monkeypatch):
    from services.common import plot

    drawn = []
    monkeypatch.setattr(plot, "_save", lambda fig, path: drawn.append(fig) or path)
    records = [{**record(s, 5.0 - 0.1 * s), **({"eval_loss": 4.5 - 0.1 * s} if s % 5 == 0 else {})}
               for s in range(1, 21)]
    plot.plot_loss(records, tmp_path / "loss.png")
    lines = {line.get_label(): line for line in drawn[0].axes[0].get_lines()}
    assert list(lines["held out"].get_xdata()) == [5, 10, 15, 20]
    assert list(lines["held out"].get_ydata()) == pytest.approx([4.0, 3.5, 3.0, 2.5])
    assert len(lines["training"].get_xdata()) == 20
