"""Run a command and report every process it left behind.

    python tests/launcher_harness.py STRAYS_JSON -- CMD ...

The harness makes itself a child subreaper, so any descendant of CMD that outlives CMD is re-parented to it; after CMD
exits it lists those (the strays), ends them, and writes their command lines to STRAYS_JSON. SIGINT/SIGTERM sent to
the harness are forwarded to CMD, the way a terminal's Ctrl-C or a supervisor's stop would reach it.

`run(...)` is the pytest-side helper.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.common import procs  # noqa: E402


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str
    strays: list[str]  # command lines of processes CMD left running

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def start(cmd: list[str], tmp: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
    strays_file = tmp / f"strays-{time.monotonic_ns()}.json"
    proc = subprocess.Popen([sys.executable, __file__, str(strays_file), "--", *cmd], cwd=ROOT,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    return proc, strays_file


def finish(proc: subprocess.Popen, strays_file: Path, timeout: float = 60) -> Result:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the harness forwards it and still sweeps
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"command did not finish within {timeout}s; stderr:\n{err}\nstdout:\n{out}")
    strays = json.loads(strays_file.read_text()) if strays_file.exists() else ["(harness wrote no report)"]
    return Result(proc.returncode, out, err, strays)


def run(cmd: list[str], tmp: Path, env: dict[str, str] | None = None, timeout: float = 60) -> Result:
    proc, strays_file = start(cmd, tmp, env)
    return finish(proc, strays_file, timeout)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return f"pid {pid}"


def _main(argv: list[str]) -> int:
    strays_file, sep, *cmd = argv
    assert sep == "--" and cmd, __doc__
    if not procs.become_subreaper():
        raise SystemExit("the harness needs Linux (PR_SET_CHILD_SUBREAPER) to see stray processes")
    child = subprocess.Popen(cmd)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    rc = child.wait()
    time.sleep(0.3)  # let descendants of CMD that were exiting anyway finish doing so
    strays = [p for p in procs.children_of(os.getpid())]
    described = [_cmdline(p) for p in strays]
    procs.sweep_orphans(known=set())
    Path(strays_file).write_text(json.dumps(described))
    return rc if rc >= 0 else 128 - rc  # killed by a signal: report it the way a shell does


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
