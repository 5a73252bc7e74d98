"""A rank and a writer on the same host share a snapshot through /dev/shm instead of sending its bytes over ZMQ.

Both sides of that protocol: the writer publishes a probe file with a random token (`make_shm_probe`, its path and
token go into its registry record); a trainer rank that can read the token from the directory its own snapshot files
are in (`shares_memory_with`) names its snapshot file in the parts' headers; the writer maps that file read-only
(`SharedSnapshot`) and writes the tensors straight from it. A hostname match alone would not prove the directory is
shared: containers on one host have their own /dev/shm.
"""

from __future__ import annotations

import mmap
import os
import uuid
from pathlib import Path
from typing import Any

from proto import checkpointer_pb2 as pb
from services.checkpointer.arena import SHM_PREFIX, process_alive, shm_dir
from services.checkpointer.layout import DTYPE_NAMES, Blob


class SharedSnapshot:
    """A read-only mapping of one rank's snapshot file (services/checkpointer/arena.py) for the parts that name it."""

    def __init__(self, path: str):
        if not Path(path).name.startswith(SHM_PREFIX):
            raise ValueError(f"shm_path {path!r} is not a foldmoe snapshot file")
        fd = os.open(path, os.O_RDONLY)
        try:
            self.size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, self.size, access=mmap.ACCESS_READ) if self.size else None
        finally:
            os.close(fd)  # the mapping keeps the file alive, even once the trainer unlinks it
        self.path = path

    def blob(self, r: pb.TensorRecord) -> Blob:
        dtype, data = self.bytes_of(r.name, r.dtype, r.shape, r.shm_offset)
        return Blob(dtype, tuple(r.shape), data)

    def bytes_of(self, name: str, dtype_name: str, shape, offset: int) -> tuple[Any, memoryview]:
        """The torch dtype named `dtype_name` (e.g. "bfloat16") and the bytes of tensor `name`, of `shape`, at byte
        `offset`: a view of the mapping, checked to lie inside it."""
        dtype = DTYPE_NAMES.get(dtype_name)
        if dtype is None:
            raise ValueError(f"tensor {name!r} has unknown dtype {dtype_name!r}")
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"tensor {name!r} at [{offset}, {offset + nbytes}) lies outside {self.path} "
                             f"({self.size} bytes)")
        return dtype, memoryview(self._map)[offset:offset + nbytes] if nbytes else memoryview(b"")

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still referenced; the mapping goes when it is collected
                pass
            self._map = None


def make_shm_probe() -> tuple[str, str]:
    """(path, token) of a file only processes sharing our /dev/shm can read; ("", "") where there is none."""
    directory = shm_dir()
    if not directory.is_dir():
        return "", ""
    for stale in directory.glob("foldmoe-writer-pid*.probe"):  # left by writers that were killed
        pid = stale.name.removeprefix("foldmoe-writer-pid").split("-")[0]
        if pid.isdigit() and not process_alive(int(pid)):
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
