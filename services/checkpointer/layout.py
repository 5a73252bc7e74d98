"""The on-disk format: directory names, shard files, per-rank records, the manifest, and their verification.

    {dir}/step_00000100/            a committed checkpoint (the rename is the commit)
        rank00000_part000.safetensors   one file per part a rank sent; safetensors with a `foldmoe` metadata entry
        rank00000.json                  what rank 0 contributed: files with sha256, boxes, its `extra`
        manifest.json                   written last: every file's sha256 and size, every tensor's shards, the extras
        keep                            optional marker: exempt from retention (not covered by the manifest)
    {dir}/step_00000150.tmp/        a save in progress (never loaded)
    {dir}/latest                    name of the newest committed checkpoint (a hint; loaders verify and fall back)
    {dir}/.store_id                 a random id, made by the first writer: a trainer whose checkpoint.dir holds the id
                                    its checkpointer registered sees the same files and reads them itself

Shard files are written by a streaming safetensors encoder so the writer hashes bytes as they go to disk and never
builds the whole file in memory; the result is read by the stock `safetensors` library.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = "foldmoe-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
KEEP = "keep"
TMP_SUFFIX = ".tmp"
STORE_ID = ".store_id"
TRASH_SUFFIX = ".trash"
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_HASH_CHUNK = 8 << 20
_WRITE_CHUNK = 4 << 20  # hashed then written while cache-hot

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in _ST_DTYPES}


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupt; the message names the file and the problem."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def parse_step(name: str) -> int | None:
    """The step of a committed checkpoint directory name; None for anything else (tmp, trash, files)."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def checkpoint_dirs(root: str | Path) -> list[Path]:
    """The directories under `root` named as committed checkpoints (step_N), newest first; [] when there is no `root`.
    Named so only by a commit (the writer stages under another name), so each was committed once: whether it still
    verifies is `verify`'s business."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = ((parse_step(p.name), p) for p in root.iterdir() if p.is_dir() and parse_step(p.name) is not None)
    return [p for _, p in sorted(found, reverse=True)]


def shard_file_name(rank: int, part: int) -> str:
    return f"rank{rank:05d}_part{part:03d}.safetensors"


def rank_record_name(rank: int) -> str:
    return f"rank{rank:05d}.json"


# ---------------------------------------------------------------- durability


def fsync_dir(path: Path) -> None:
    """Persist a directory's entries (creations, renames) — a renamed file is not durable until its parent is synced."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_store_id(root: str | Path) -> str:
    """The id of the checkpoint directory `root` (see the module doc); "" when it has none or cannot be read."""
    try:
        return (Path(root) / STORE_ID).read_text().strip()
    except OSError:
        return ""


def ensure_store_id(root: Path) -> str:
    """`root`'s id, made on first use. The id file appears whole or not at all (a hard link of a durable temporary
    file), and of several writer replicas starting beside each other on one directory the first link wins."""
    if found := read_store_id(root):
        return found
    tmp = root / f"{STORE_ID}.{uuid.uuid4().hex}"
    write_durable(tmp, uuid.uuid4().hex.encode())
    try:
        os.link(tmp, root / STORE_ID)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    fsync_dir(root)
    return read_store_id(root)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------- shard files


@dataclass
class Box:
    """One saved piece of a global tensor; `key`: its name inside `file` (the tensor's name, or a piece key when its
    rank saved several pieces of the tensor: shard.piece_key)."""
    file: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    key: str


@dataclass
class Blob:
    """A tensor's raw bytes (C order) without a torch tensor around them, e.g. a slice of a read-only mapping of the
    trainer's shared snapshot file: the writer streams it to disk without copying it first."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    data: memoryview

    @property
    def nbytes(self) -> int:
        return len(self.data)


def _tensor_bytes(t: torch.Tensor | Blob) -> memoryview:
    if isinstance(t, Blob):
        return t.data
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # flat, so len() is the byte count


def _nbytes(t: torch.Tensor | Blob) -> int:
    return t.nbytes if isinstance(t, Blob) else t.numel() * t.element_size()


def write_shard_file(path: Path, tensors: dict[str, torch.Tensor | Blob],
                     boxes: dict[str, tuple[list[int], list[int]]]) -> tuple[str, int]:
    """Write safetensors to `path` (fsynced) with each tensor's (global_shape, offsets); returns (sha256, size).

    Bytes go out in `_WRITE_CHUNK` slices, each hashed right before it is written: the slice is still in the CPU cache
    when the write copies it, so the data is read from memory once, not twice. Several files are written by as many
    threads (hashlib and file writes release the GIL)."""
    header: dict[str, Any] = {}
    start = 0
    for name, t in tensors.items():
        if t.dtype not in _ST_DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {t.dtype}, which the checkpoint format does not store "
                                  f"(supported: {sorted(DTYPE_NAMES)})")
        nbytes = _nbytes(t)
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [start, start + nbytes]}
        start += nbytes
    meta = {name: {"global_shape": list(g), "offsets": list(o)} for name, (g, o) in boxes.items()}
    header["__metadata__"] = {"foldmoe": json.dumps(meta, separators=(",", ":"))}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-byte aligned, as safetensors expects
    h = hashlib.sha256()
    size = 0
    with open(path, "wb", buffering=0) as f:
        for data in [memoryview(struct.pack("<Q", len(raw))), memoryview(raw), *(_tensor_bytes(t) for t in tensors.values())]:
            for i in range(0, len(data), _WRITE_CHUNK):
                chunk = data[i:i + _WRITE_CHUNK]
                h.update(chunk)
                written = 0
                while written < len(chunk):  # a raw write may be short
                    written += f.write(chunk[written:])
            size += len(data)
        os.fsync(f.fileno())
    return h.hexdigest(), size


# ---------------------------------------------------------------- manifest


@dataclass
class TensorEntry:
    dtype: str
    global_shape: tuple[int, ...]
    boxes: list[Box] = field(default_factory=list)


@dataclass
class Manifest:
    run: str
    step: int
    world_size: int
    files: dict[str, dict[str, Any]]  # file name -> {"sha256", "bytes", "rank"}
    tensors: dict[str, TensorEntry]
    extras: list[dict[str, Any]]  # one per rank, index = rank
    created: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": FORMAT_VERSION, "run": self.run, "step": self.step,
                "world_size": self.world_size, "created": self.created, "files": self.files,
                "tensors": {n: {"dtype": e.dtype, "global_shape": list(e.global_shape),
                                "shards": [{"file": b.file, "offsets": list(b.offsets), "shape": list(b.shape),
                                            **({"key": b.key} if b.key != n else {})}
                                           for b in e.boxes]} for n, e in self.tensors.items()},
                "extras": self.extras}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Manifest:
        if obj.get("format") != FORMAT or obj.get("version") != FORMAT_VERSION:
            raise ValueError(f"format {obj.get('format')!r} version {obj.get('version')!r} is not "
                             f"{FORMAT!r} version {FORMAT_VERSION}")
        tensors = {n: TensorEntry(e["dtype"], tuple(e["global_shape"]),
                                  [Box(s["file"], tuple(s["offsets"]), tuple(s["shape"]), s.get("key", n))
                                   for s in e["shards"]])
                   for n, e in obj["tensors"].items()}
        return cls(obj["run"], int(obj["step"]), int(obj["world_size"]), dict(obj["files"]), tensors,
                   list(obj["extras"]), float(obj.get("created", 0.0)))


def read_manifest(ckpt: Path) -> Manifest:
    path = ckpt / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: {ckpt} was never committed or was damaged")
    try:
        return Manifest.from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is not a valid manifest ({e}); the checkpoint is damaged") from None


def verify(ckpt: Path, checksums: bool = True) -> Manifest:
    """The manifest of `ckpt` after checking every listed file's presence and size (and sha256 with `checksums`)."""
    manifest = read_manifest(ckpt)
    for name, entry in manifest.files.items():
        path = ckpt / name
        if not path.is_file():
            raise CheckpointError(f"{path} is listed in the manifest but missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{path} has {size} bytes, the manifest says {entry['bytes']} (truncated or "
                                  "overwritten)")
        if checksums and sha256_file(path) != entry["sha256"]:
            raise CheckpointError(f"{path} fails its sha256 check: the file is corrupt")
    return manifest


def check_tiling(name: str, entry: TensorEntry) -> None:
    """Every element of the global tensor is saved exactly once (identical replicated boxes count once)."""
    unique = {(b.offsets, b.shape) for b in entry.boxes}
    g = np.array(entry.global_shape, dtype=np.int64)
    numel = int(np.prod(g)) if len(g) else 1
    lo = np.array([u[0] for u in unique], dtype=np.int64).reshape(len(unique), len(g))
    hi = lo + np.array([u[1] for u in unique], dtype=np.int64).reshape(len(unique), len(g))
    volume = int(np.prod(hi - lo, axis=1).sum()) if len(g) else len(unique)
    # Pairwise box overlap, vectorised: boxes i and j overlap where every dimension's intervals intersect.
    nonempty = (hi > lo).all(axis=1)
    overlap = ((lo[:, None] < hi[None]) & (lo[None] < hi[:, None])).all(axis=2) if len(g) else \
        np.ones((len(unique), len(unique)), dtype=bool)
    overlap &= nonempty[:, None] & nonempty[None]
    np.fill_diagonal(overlap, False)
    if overlap.any():
        i, j = map(int, np.argwhere(overlap)[0])
        raise CheckpointError(f"tensor {name!r}: saved pieces at offsets {lo[i].tolist()} and {lo[j].tolist()} "
                              "overlap with different shapes; ranks disagree on the sharding")
    if volume != numel:
        raise CheckpointError(f"tensor {name!r} {list(entry.global_shape)}: the ranks' pieces cover {volume} of "
                              f"{numel} elements; a rank did not send its piece (or sent a wrong box)")
