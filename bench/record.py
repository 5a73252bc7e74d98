"""A benchmark's table: printed as it is built and, with `--record PATH`, appended to PATH (bench/RESULTS.md) with
what made it.

    table = Table()
    table.line("...")                                  # printed now, kept for the record
    table.record(args.record, "MoE layer alone vs the transformers blocks")   # `--record bench/RESULTS.md`

The entry names the machine (GPU model and count, else the CPU), the torch and Triton versions, the command line, the
code (`git describe --always --dirty`; FOLDMOE_COMMIT overrides it where the checkout's HEAD is not the code that
ran, as on a device machine given a copy of a working tree) and the UTC time, then the table as printed. What the
figures mean is left for a person to write under it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def add_record_argument(parser: argparse.ArgumentParser) -> None:
    # PATH is not optional: a bare `--record` would take the next word, and bench_train_step's overrides follow.
    parser.add_argument("--record", default=None, metavar="PATH",
                        help="append the table, with machine, command and commit, to PATH (bench/RESULTS.md)")


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        what = f"{n} x {torch.cuda.get_device_name(0)}" if n > 1 else torch.cuda.get_device_name(0)
    else:
        what = f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    versions = f"torch {torch.__version__}"
    try:
        import triton

        versions += f", Triton {triton.__version__}"
    except ImportError:
        pass
    return f"{what} ({versions}, Python {platform.python_version()})"


def code_version() -> str:
    if os.environ.get("FOLDMOE_COMMIT"):
        return os.environ["FOLDMOE_COMMIT"]
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=RESULTS.parent, capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (git did not run)"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown (not a git checkout)"


def entry(title: str, lines: list[str]) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = shlex.join(["python", os.path.relpath(sys.argv[0], RESULTS.parent.parent), *sys.argv[1:]])
    return (f"\n## {title} (recorded by the bench)\n- Machine: {machine()}, {when}; code {code_version()}.\n"
            f"- Command: `{command}`\n\n```\n" + "\n".join(lines) + "\n```\n")


class Table:
    """Lines printed at once and kept, to be recorded together."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def line(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.extend(text.split("\n"))

    def record(self, path: str | None, title: str) -> None:
        """Append this table as an entry of `path` (nothing when `path` is None)."""
        if path is None:
            return
        with open(path, "a", encoding="utf-8") as f:
            f.write(entry(title, self.lines))
        print(f"recorded in {path}")
