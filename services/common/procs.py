"""Process hygiene for the launcher: children that die with it, process-group stop, and a sweep for orphans; and for
the services it stops: signal handlers that set their stop event and report a stop that takes too long.

Linux gives two guarantees that plain `subprocess` does not: a child can ask to be signalled when its parent dies
(PR_SET_PDEATHSIG), and a process can adopt its orphaned descendants (PR_SET_CHILD_SUBREAPER). Together they let the
launcher promise that no process it started outlives it, even when a child (torchrun) starts grandchildren in sessions
of their own. Elsewhere these are no-ops and the process-group stop is the only guarantee.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36

# Resolved before any fork: the pre-exec hook must not load libraries in the child.
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_prctl = _libc.prctl if _libc is not None else None


def die_with_parent() -> None:
    """`preexec_fn` for children: SIGTERM them when the process that started them dies, however it dies."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


STOP_GRACE_ENV = "FOLDMOE_STOP_GRACE"  # seconds between the SIGTERM a service gets and the SIGKILL that may follow it
DEFAULT_STOP_GRACE = 10.0  # the launcher's and docker's default


def stop_grace() -> float:
    """The stop grace period this service runs under: `FOLDMOE_STOP_GRACE` (set by the launcher from its own, and by
    compose/docker-compose.yml to match its `stop_grace_period`), 10 s when unset."""
    raw = os.environ.get(STOP_GRACE_ENV, "").strip()
    if not raw:
        return DEFAULT_STOP_GRACE
    try:
        grace = float(raw)
    except ValueError:
        grace = -1.0
    if not grace > 0 or grace == float("inf"):
        raise ValueError(f"{STOP_GRACE_ENV}={raw!r}: expected the seconds between SIGTERM and SIGKILL, a positive "
                         f"number")
    return grace


def stop_on_signals(stop: threading.Event) -> None:
    """A service's SIGTERM and SIGINT set `stop` (its main thread does the cleaning up) and arm a dump of every thread's
    stack to stderr, the service's log, at half the stop grace period: a stop that would outlast the grace says what
    it waited on before the SIGKILL. The grace (`stop_grace`) is read here, so call this before starting anything:
    a malformed value then fails the start with nothing to undo."""
    after = stop_grace() / 2

    def handler(*_) -> None:
        stop.set()
        faulthandler.dump_traceback_later(after, exit=False, file=sys.stderr)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def become_subreaper() -> bool:
    """Adopt orphaned descendants (e.g. torchrun's workers if torchrun dies first) so `sweep_orphans` can end them."""
    return _prctl is not None and _prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (zombies excluded), read from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # Fields after the command name, which is in parentheses and may itself contain spaces or parentheses.
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            found.append(int(entry.name))
    return found


def reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def sweep_orphans(known: set[int], grace: float = 2.0) -> list[int]:
    """End every child of this process not in `known`: descendants orphaned by a child that died before them."""
    strays = [p for p in children_of(os.getpid()) if p not in known]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in strays:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(alive(p) for p in strays):
            for pid in strays:
                reap(pid)
            time.sleep(0.05)
    for pid in strays:
        reap(pid)
    return strays


def alive(pid: int) -> bool:
    """Whether process `pid` runs (another user's counts; a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    # A zombie still answers signal 0; it is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the process group the child leads (it was started with `start_new_session=True`)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is empty: every member has exited


def stop_group(proc: subprocess.Popen, grace: float, hurry=lambda: False) -> bool:
    """SIGTERM the child's group, SIGKILL it after `grace` seconds (or as soon as `hurry()` turns true).

    Returns True when the child stopped within the grace period.
    """
    signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while proc.poll() is None and time.monotonic() < deadline and not hurry():
        time.sleep(0.05)
    graceful = proc.poll() is not None
    # Also after a clean exit of the leader: members of its group (its own children) may still be running.
    signal_group(proc, signal.SIGKILL)
    proc.wait()
    return graceful
