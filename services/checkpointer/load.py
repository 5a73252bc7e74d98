"""Reading checkpoints back: find the newest one that verifies, and read any box of any saved tensor.

`Checkpoint.read(name, offsets, shape)` assembles the requested slice of the global tensor from whichever saved pieces
overlap it, reading only the overlapping bytes (safetensors slices are memory-mapped). That is all resharding needs:
a new parallel layout asks for exactly its own piece, whatever layout wrote the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Self

import torch
from safetensors import safe_open

from services.checkpointer.layout import (DTYPE_NAMES, MANIFEST, CheckpointError, Manifest, TensorEntry, checkpoint_dirs,
                                          parse_step, step_dir_name, verify)
from services.common import logs

log = logs.logger("checkpointer")


def find_latest_valid(root: str | Path, checksums: bool = True) -> Path | None:
    """The newest committed checkpoint under `root` that verifies; skipped ones are logged with the reason."""
    return newest_valid(root, checksums)[0]


def require_latest_valid(root: str | Path, checksums: bool = True) -> Path | None:
    """As `find_latest_valid`, but checkpoints none of which verifies are an error (CheckpointError naming each one's
    problem), not a fresh start: a run that started over beside them would have its own saves deleted by retention
    (the writer keeps the newest by step) while they hold the history. None only when `root` holds none."""
    path, problems = newest_valid(root, checksums)
    if path is None and problems:
        raise CheckpointError(f"{root} holds {len(problems)} checkpoint(s) and none verifies ({'; '.join(problems)})")
    return path


def resolve_checkpoint(spec: str | Path) -> Path:
    """A committed checkpoint directory itself (it must verify), or the newest checkpoint that verifies under a
    directory of them (a checkpoint.dir). CheckpointError names what is wrong."""
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"{path}: {'not a directory' if path.exists() else 'no such directory'}")
    if (path / MANIFEST).is_file() or parse_step(path.name) is not None:
        verify(path)
        return path
    latest = find_latest_valid(path)
    if latest is None:
        raise CheckpointError(f"{path} holds no committed checkpoint that verifies")
    return latest


def newest_valid(root: str | Path, checksums: bool,
                 verified: set[tuple] | None = None) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under `root` that verifies (or None), and the problems of the newer ones skipped.
    `verified`: the `fingerprint` of each checkpoint already checked with checksums, which this skips and adds to."""
    problems = []
    for path in checkpoint_dirs(root):
        try:
            key = fingerprint(path) if verified is not None and checksums else None
            if key is None or key not in verified:
                verify(path, checksums=checksums)
            if key is not None:
                verified.add(key)
            return path, problems
        except CheckpointError as e:
            log.warning("skipping checkpoint %s: %s", path, e)
            problems.append(f"{path.name}: {e}")
    return None, problems


def identity(path: Path) -> tuple:
    """What tells one commit of `path` from another (a step deleted and saved again): its manifest's inode and mtime.
    CheckpointError when `path` holds no manifest."""
    try:
        st = (path / MANIFEST).stat()
    except OSError as e:
        raise CheckpointError(f"{path}: no committed checkpoint ({e.strerror})") from None
    return str(path), st.st_ino, st.st_mtime_ns


def fingerprint(path: Path) -> tuple:
    """`identity` and every file's name, size and mtime: a checkpoint verified once needs no second check until one of
    its files is written again."""
    try:
        files = tuple(sorted((p.name, st.st_size, st.st_mtime_ns) for p in path.iterdir() for st in [p.stat()]))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be listed ({e})") from None
    return identity(path), files


def resolve_box(name: str, global_shape: tuple[int, ...], offsets=None, shape=None) -> tuple[tuple, tuple]:
    """(offsets, shape) of a box of tensor `name`: `offsets` default to the origin, `shape` to the end. ValueError when
    the box is not inside the tensor."""
    g = tuple(global_shape)
    lo = tuple(offsets) if offsets is not None else (0,) * len(g)
    size = tuple(shape) if shape is not None else tuple(s - o for s, o in zip(g, lo))
    if len(lo) != len(g) or len(size) != len(g) or any(o < 0 or n < 0 or o + n > s for o, n, s in zip(lo, size, g)):
        raise ValueError(f"box offsets={list(lo)} shape={list(size)} is outside tensor {name!r} of global shape "
                         f"{list(g)}")
    return lo, size


class DirectorySource:
    """The checkpoints a trainer resumes from, read straight from a checkpoint.dir this host sees (the other source
    is services/checkpointer/remote.py's `ServiceSource`, the same two methods over gRPC). `verified_by`: the
    `ServiceSource` of the checkpointer writing this directory, which then picks the newest checkpoint that verifies
    and checks its checksums once for every rank, instead of each rank reading every file to hash it. The source owns
    it: `close()` (or leaving a `with` block) closes its channel."""

    def __init__(self, root: str | Path, verified_by=None):
        self.root = Path(root)
        self.where = str(root)
        self.verified_by = verified_by

    def saved(self) -> list[str]:
        """The committed checkpoints' directory names, newest first (not verified)."""
        return [p.name for p in checkpoint_dirs(self.root)]

    def newest(self, checksums: bool = True) -> Checkpoint | None:
        """The newest checkpoint that verifies, opened; None when there is none; CheckpointError when some are there and
        none verifies (`require_latest_valid`)."""
        if self.verified_by is None:
            path = require_latest_valid(self.root, checksums)
        else:
            # The checkpointer's only answer needed is which step; its files are read from here, so its channel is
            # closed at once rather than held for the run (a later call opens another).
            with self.verified_by:
                found = self.verified_by.newest(checksums)
            path = None if found is None else self.root / step_dir_name(found.step)
        return None if path is None else load_checkpoint(path, checksums=False)

    def close(self) -> None:
        if self.verified_by is not None:
            self.verified_by.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


Box = tuple[str, tuple[int, ...] | None, tuple[int, ...] | None]  # (name, offsets, shape): `read`'s arguments


class CheckpointReader:
    """What an opened checkpoint tells before any read: its tensors' names, global shapes and dtypes. `Checkpoint`
    reads the box of a tensor from the files, remote.py's `RemoteCheckpoint` through the checkpointer's load socket;
    both are context managers."""

    path: Any  # where the checkpoint is, for messages
    _tensors: dict[str, Any]  # name -> a `TensorEntry` or the service's `TensorInfo`: both have dtype and global_shape

    def names(self) -> list[str]:
        return sorted(self._tensors)

    def _entry(self, name: str):
        entry = self._tensors.get(name)
        if entry is None:
            raise KeyError(f"tensor {name!r} is not in checkpoint {self.path} ({len(self._tensors)} tensors; "
                           "see names())")
        return entry

    def global_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name).global_shape)

    def dtype(self, name: str) -> torch.dtype:
        return DTYPE_NAMES[self._entry(name).dtype]

    def read_boxes(self, boxes: Iterable[Box]) -> Iterator[torch.Tensor]:
        """Each of `boxes` ((name, offsets, shape), as `read` takes them), in order. A restore asks for all of its boxes
        in one call: read from the files here, they come one after another; the checkpointer's reader keeps requests
        for the next ones in flight meanwhile. Close the iterator (or exhaust it) when done."""
        for box in boxes:
            yield self.read(*box)

    def close(self) -> None:
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Checkpoint(CheckpointReader):
    """A committed checkpoint opened for reading; use as a context manager or call `close()`."""

    def __init__(self, path: Path, manifest: Manifest):
        self.path, self.manifest = path, manifest
        self._tensors: dict[str, TensorEntry] = manifest.tensors
        self.step = manifest.step
        self.extras: list[dict[str, Any]] = manifest.extras  # one per saving rank
        self.extra: dict[str, Any] = manifest.extras[0] if manifest.extras else {}
        self._files: dict[str, Any] = {}

    def _open(self, file: str):
        handle = self._files.get(file)
        if handle is None:
            path = self.path / file
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:
                raise CheckpointError(f"{path} cannot be read as safetensors ({e}); the file is corrupt or "
                                      "truncated") from None
            self._files[file] = handle
        return handle

    def read(self, name: str, offsets: tuple[int, ...] | None = None,
             shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The box of global tensor `name` starting at `offsets` (default: origin) of `shape` (default: to the end)."""
        entry = self._entry(name)
        lo, size = resolve_box(name, entry.global_shape, offsets, shape)
        out = None  # allocated only when pieces must be assembled
        seen: set[tuple] = set()
        for box in entry.boxes:
            if (box.offsets, box.shape) in seen:  # replicated copies: one is enough
                continue
            seen.add((box.offsets, box.shape))
            a = [max(o, bo) for o, bo in zip(lo, box.offsets)]
            b = [min(o + n, bo + bn) for o, n, bo, bn in zip(lo, size, box.offsets, box.shape)]
            if any(x >= y for x, y in zip(a, b)):
                continue
            piece = self._read_piece(box.key, box.file,
                                     [slice(x - bo, y - bo) for x, y, bo in zip(a, b, box.offsets)])
            if tuple(piece.shape) == tuple(size):  # one saved piece covers the whole box: no assembly copy
                return piece
            if out is None:
                out = torch.empty(size, dtype=DTYPE_NAMES[entry.dtype])
            out[tuple(slice(x - o, y - o) for x, y, o in zip(a, b, lo))] = piece
        return out if out is not None else torch.empty(size, dtype=DTYPE_NAMES[entry.dtype])

    def _read_piece(self, name: str, file: str, index: list[slice]) -> torch.Tensor:
        try:
            handle = self._open(file)
            if not index:  # a 0-d tensor has nothing to slice
                return handle.get_tensor(name)
            return handle.get_slice(name)[tuple(index)]
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{self.path / file}: reading {name!r} failed ({e}); the file is corrupt") from None

    def close(self) -> None:
        self._files.clear()


def load_checkpoint(path: str | Path, checksums: bool = True) -> Checkpoint:
    """Open a committed checkpoint after verifying it (sha256 of every file unless `checksums=False`)."""
    path = Path(path)
    return Checkpoint(path, verify(path, checksums=checksums))
