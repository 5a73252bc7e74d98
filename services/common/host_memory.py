"""Host memory that device tensors are copied into and other processes on the host read: one mapping laid out once
for a fixed set of tensors and reused (`HostArena`), and the reader's side of it (`SharedFile`). A trainer rank's
checkpoint snapshots live in one (services/checkpointer/snapshot.py, read by the checkpoint writer), the RL trainer's
published weights in others (services/trainer/rl/weight_publisher.py, read by the rollout workers).

Why one mapping, allocated ahead of the first use:
- page-locking tens of GB costs seconds (that was the first save's whole stall), so it is paid once, off the step path;
- a mapping of a file in /dev/shm is readable by another process on the same host: the checkpoint writer (or a
  rollout worker) reads the tensors straight from it, so no byte crosses a socket (ZMQ stays the path to another host);
- `cudaHostRegister` on exactly the bytes needed; `torch.empty(pin_memory=True)` would round every tensor (or one flat
  buffer) up to a power of two in the caching host allocator, up to twice the memory for a 22 GB state.

Each tensor starts on a page boundary and is registered with CUDA on its own (a copy never spans two registrations).
When /dev/shm is missing or too small the arena falls back to anonymous memory: still pinned, only ZMQ can ship it.
"""

from __future__ import annotations

import mmap
import os
import re
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common import logs, procs

log = logs.logger("host_memory")

PAGE = mmap.PAGESIZE
CUDA_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the device only reads the registered range
SHM_PREFIX = "foldmoe-shm-"
_STALE_RE = re.compile(rf"^{SHM_PREFIX}pid(\d+)-")


def shm_dir() -> Path:
    """Where shared buffer files live; FOLDMOE_SHM_DIR overrides /dev/shm (tests, hosts with tmpfs elsewhere)."""
    return Path(os.environ.get("FOLDMOE_SHM_DIR", "/dev/shm"))


@dataclass(frozen=True)
class TensorSpec:
    """What a buffer must hold: the arena is reused only while every saved tensor keeps its shape and dtype."""
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(tuple(t.shape), t.dtype)


def _align(n: int) -> int:
    return -(-n // PAGE) * PAGE


def remove_stale_files(directory: Path | None = None) -> list[Path]:
    """Delete buffer files whose process is gone (a crashed rank never unlinks its arena)."""
    directory = directory or shm_dir()
    removed = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for p in entries:
        m = _STALE_RE.match(p.name)
        if m is None or procs.alive(int(m.group(1))):
            continue
        try:
            p.unlink()
            removed.append(p)
        except OSError:
            pass
    return removed


def clear_cuda_error() -> None:
    """Take a failed CUDA runtime call's error off this host thread, after the failure has been handled.

    The runtime keeps a failed call's error as the thread's "last error" until something reads it, and PyTorch reads
    it after its next kernel launch: an unrelated operation then fails with the stale error (a cudaHostRegister that
    CUDA refused surfaced as "CUDA error: invalid argument" in the next `normal_`). `torch.cuda.cudart()` does not
    bind cudaGetLastError, so this launches a kernel and lets PyTorch's check read (and so reset) the error here.
    """
    try:
        torch.ones(1, device=torch.device("cuda", torch.cuda.current_device()))  # a fill kernel, checked at launch
    except torch.AcceleratorError as e:
        log.debug("cleared a handled CUDA error: %s", str(e).splitlines()[0])


class HostArena:
    """Host buffers for `specs` in one mapping. `pin=True` registers them with CUDA (needs a CUDA device)."""

    def __init__(self, specs: dict[str, TensorSpec], *, pin: bool, shared: bool = True, tag: str = "",
                 what: str = "snapshot"):
        """`tag`: part of the shared file's name; `what`: what the buffers hold, for the log ("snapshot", "weights")."""
        self.specs, self.what = dict(specs), what
        self.offsets: dict[str, int] = {}
        size = 0
        for name, spec in self.specs.items():
            self.offsets[name] = size
            size += _align(max(spec.nbytes, 1))
        self.size = max(size, PAGE)
        self.path: Path | None = None
        self._fd = -1
        self._map = self._map_shared(tag) if shared else None
        self.views: dict[str, torch.Tensor] = {}
        self._registered: list[int] = []
        if self._map is not None:
            try:
                self._lay_out(pin)
                return
            except RuntimeError as e:
                # CUDA page-locks shared mappings of tmpfs files only (FOLDMOE_SHM_DIR on a disk filesystem fails).
                log.warning("%s buffers in anonymous memory: %s cannot be page-locked (%s); a reader on this "
                            "host will receive them over ZMQ", self.what, self.path, e)
                self.close()
        self._map = mmap.mmap(-1, self.size)
        try:
            self._lay_out(pin)
        except Exception:
            self.close()
            raise

    def _lay_out(self, pin: bool) -> None:
        base = torch.frombuffer(self._map, dtype=torch.uint8)
        try:
            for name, spec in self.specs.items():
                off, nbytes = self.offsets[name], spec.nbytes
                self.views[name] = base[off:off + nbytes].view(spec.dtype).view(spec.shape)
                if pin and nbytes:
                    self._register(self.views[name].data_ptr(), nbytes)
        finally:
            del base  # only the views keep the mapping referenced (close() drops them)

    def _map_shared(self, tag: str) -> mmap.mmap | None:
        directory = shm_dir()
        if not directory.is_dir():
            return None
        path = directory / f"{SHM_PREFIX}pid{os.getpid()}-{tag}{uuid.uuid4().hex[:8]}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            log.warning("%s buffers in anonymous memory: cannot create %s (%s)", self.what, path, e)
            return None
        try:
            # Reserve every page now: a tmpfs that is too small fails here, not with SIGBUS in the middle of a save.
            os.posix_fallocate(fd, 0, self.size)
            mapped = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            log.warning("%s buffers in anonymous memory: %s cannot hold %.2f GB (%s); a reader on this host "
                        "will receive them over ZMQ (enlarge /dev/shm, e.g. docker --shm-size)", self.what, directory,
                        self.size / 1e9, e)
            return None
        self.path, self._fd = path, fd
        return mapped

    def _register(self, ptr: int, nbytes: int) -> None:
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
        if err != 0:
            clear_cuda_error()
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with cudaError {err}; the host may limit "
                               "locked memory (ulimit -l) or be out of memory")
        self._registered.append(ptr)

    def matches(self, specs: dict[str, TensorSpec]) -> bool:
        return specs == self.specs

    @property
    def shared(self) -> bool:
        return self.path is not None

    def close(self) -> None:
        """Unpin, unmap and unlink. A writer still reading keeps its own mapping of the (unlinked) file valid."""
        for ptr in self._registered:
            err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
            if err != 0:
                clear_cuda_error()
                log.warning("cudaHostUnregister of a %s buffer failed with cudaError %d", self.what, err)
        self._registered = []
        self.views = {}
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view escaped; the mapping lives until it is collected
                log.debug("%s arena still referenced at close", self.what)
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None


class SharedFile:
    """A read-only mapping of another process's arena file, for the tensors its producer names by place (`bytes_of`).
    The mapping keeps the file's pages alive even once the producer unlinks it."""

    def __init__(self, path: str):
        if not Path(path).name.startswith(SHM_PREFIX):
            raise ValueError(f"{path!r} is not a foldmoe shared buffer file")
        fd = os.open(path, os.O_RDONLY)
        try:
            self.size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, self.size, access=mmap.ACCESS_READ) if self.size else None
        finally:
            os.close(fd)
        self.path = path
        self._registered = 0  # address of our read-only CUDA registration of the whole mapping (0: none)

    def pin(self) -> bool:
        """Register the mapping with CUDA, read-only, so copies from it to a device run by DMA at the link's rate rather
        than through the driver's pageable staging. Costs about as much as one such copy (the pages are locked), so
        it pays for files read again and again. False, with nothing held, where CUDA refuses (no read-only host
        registration on this device or driver, or the host limits locked memory)."""
        if self._map is None or self._registered:
            return bool(self._registered)
        with warnings.catch_warnings():  # torch warns that the read-only mapping is not writable: CUDA only reads it
            warnings.simplefilter("ignore", UserWarning)
            ptr = torch.frombuffer(self._map, dtype=torch.uint8).data_ptr()
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, self.size, CUDA_HOST_REGISTER_READ_ONLY))
        if err != 0:
            clear_cuda_error()
            log.warning("reading %s from pageable memory: CUDA refused a read-only registration of it (cudaError %d)",
                        self.path, err)
            return False
        self._registered = ptr
        return True

    def bytes_of(self, name: str, dtype_name: str, shape, offset: int) -> tuple[torch.dtype, memoryview]:
        """The torch dtype named `dtype_name` (e.g. "bfloat16") and the bytes of tensor `name`, of `shape`, at byte
        `offset`: a view of the mapping, checked to lie inside it."""
        dtype = getattr(torch, dtype_name, None) if dtype_name.isidentifier() else None
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"tensor {name!r} has unknown dtype {dtype_name!r}")
        nbytes = TensorSpec(tuple(shape), dtype).nbytes
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"tensor {name!r} at [{offset}, {offset + nbytes}) lies outside {self.path} "
                             f"({self.size} bytes)")
        return dtype, memoryview(self._map)[offset:offset + nbytes] if nbytes else memoryview(b"")

    def close(self) -> None:
        """Unregister and unmap. Tensors still viewing the mapping keep it (unregistered) until they are collected."""
        if self._registered:
            err = int(torch.cuda.cudart().cudaHostUnregister(self._registered))
            if err != 0:
                clear_cuda_error()
                log.warning("cudaHostUnregister of %s failed with cudaError %d", self.path, err)
            self._registered = 0
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still referenced; the mapping goes when it is collected
                pass
            self._map = None
