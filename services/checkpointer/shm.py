"""A rank and a writer on the same host share a snapshot through /dev/shm instead of sending its bytes over ZMQ.

Both sides of that protocol: the writer publishes a probe file with a random token (`make_shm_probe`, its path and
token go into its registry record); a trainer rank that can read the token from the directory its own snapshot files
are in (`shares_memory_with`) names its snapshot file in the parts' headers; the writer maps that file read-only
(`SharedSnapshot`) and writes the tensors straight from it. A hostname match alone would not prove the directory is
shared: containers on one host have their own /dev/shm.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from proto import checkpointer_pb2 as pb
from services.checkpointer.layout import Blob
from services.common import procs
from services.common.host_memory import SharedFile, shm_dir


class SharedSnapshot(SharedFile):
    """A read-only mapping of one rank's snapshot file (services/common/host_memory.py) for the parts that name it."""

    def blob(self, r: pb.TensorRecord) -> Blob:
        dtype, data = self.bytes_of(r.name, r.dtype, r.shape, r.shm_offset)
        return Blob(dtype, tuple(r.shape), data)


def make_shm_probe() -> tuple[str, str]:
    """(path, token) of a file only processes sharing our /dev/shm can read; ("", "") where there is none."""
    directory = shm_dir()
    if not directory.is_dir():
        return "", ""
    for stale in directory.glob("foldmoe-writer-pid*.probe"):  # left by writers that were killed
        pid = stale.name.removeprefix("foldmoe-writer-pid").split("-")[0]
        if pid.isdigit() and not procs.alive(int(pid)):
            stale.unlink(missing_ok=True)
    token = uuid.uuid4().hex
    path = directory / f"foldmoe-writer-pid{os.getpid()}-{token[:12]}.probe"
    try:
        path.write_text(token)
    except OSError:
        return "", ""
    return str(path), token


def shares_memory_with(record: dict[str, Any]) -> bool:
    """True when the writer's probe file sits in our shared-memory directory with its token: the writer sees the
    directory our snapshot files are in (same host, same mount), so it can open them. A hostname match alone would
    not prove it (containers on one host have their own /dev/shm)."""
    path, token = record.get("shm_probe"), record.get("shm_token")
    if not path or not token:
        return False
    try:
        if not Path(path).parent.samefile(shm_dir()):
            return False
        with open(path) as f:
            return f.read().strip() == token
    except OSError:
        return False
