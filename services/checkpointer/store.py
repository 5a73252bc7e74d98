"""The checkpoint directory as the writer sees it: staging a save, the atomic commit, retention, keep and delete.

Commit order is what makes a crash at any moment harmless: every shard file and per-rank record is fsynced inside
`step_N.tmp/`, then the manifest is written and fsynced, then the directory is renamed to `step_N/` (the commit point)
and its parent fsynced, then `latest` is replaced atomically. Loaders only trust directories with a verified manifest,
so anything a crash leaves behind is either invisible (`*.tmp`) or complete.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.checkpointer.layout import (KEEP, LATEST, MANIFEST, TMP_SUFFIX, TRASH_SUFFIX, Box, CheckpointError,
                                          Manifest, TensorEntry, check_tiling, checkpoint_dirs, ensure_store_id,
                                          fsync_dir, parse_step,
                                          rank_record_name, read_manifest, shard_file_name, step_dir_name, verify,
                                          write_durable, write_shard_file)
from services.checkpointer.shard import tensor_name
from services.common import logs

log = logs.logger("checkpointer")


@dataclass
class CheckpointSummary:
    step: int
    path: Path
    keep: bool
    latest: bool
    bytes: int
    world_size: int
    valid: bool
    problem: str = ""


class CheckpointStore:
    """One checkpoint directory. Thread-safe: the ZMQ loop commits while gRPC handlers list, keep and delete."""

    def __init__(self, root: str | Path, keep_last: int):
        self.root = Path(root)
        self.keep_last = keep_last  # <= 0 keeps everything
        self.root.mkdir(parents=True, exist_ok=True)
        self.store_id = ensure_store_id(self.root)
        self._lock = threading.RLock()

    # ------------------------------------------------------------ staging

    def tmp_dir(self, step: int) -> Path:
        return self.root / (step_dir_name(step) + TMP_SUFFIX)

    def final_dir(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def write_part(self, step: int, rank: int, part: int, tensors: dict[str, torch.Tensor],
                   boxes: dict[str, tuple[list[int], list[int]]]) -> dict[str, Any]:
        """Stage one part; returns its entry for the rank record."""
        tmp = self.tmp_dir(step)
        tmp.mkdir(exist_ok=True)
        name = shard_file_name(rank, part)
        sha, size = write_shard_file(tmp / name, tensors, boxes)
        return {"file": name, "sha256": sha, "bytes": size,
                "tensors": {n: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                                "global_shape": boxes[n][0], "offsets": boxes[n][1]} for n, t in tensors.items()}}

    def write_rank_record(self, step: int, rank: int, parts: list[dict[str, Any]], extra: dict[str, Any]) -> None:
        """A rank's whole contribution is on disk once this record is; the committer reads only records."""
        tmp = self.tmp_dir(step)
        write_durable(tmp / rank_record_name(rank), json.dumps({"rank": rank, "parts": parts, "extra": extra}).encode())
        fsync_dir(tmp)

    def abort(self, step: int) -> None:
        shutil.rmtree(self.tmp_dir(step), ignore_errors=True)

    def clean_stale(self) -> list[Path]:
        """Remove what crashed saves and deletes left (run at writer start, when no save of this writer is open)."""
        removed = []
        for p in self.root.iterdir():
            if p.is_dir() and (p.name.endswith(TMP_SUFFIX) or p.name.endswith(TRASH_SUFFIX)):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
        return removed

    # ------------------------------------------------------------ commit

    def _manifest_from_records(self, run: str, step: int, world_size: int) -> Manifest:
        tmp = self.tmp_dir(step)
        files: dict[str, dict[str, Any]] = {}
        tensors: dict[str, TensorEntry] = {}
        extras: list[dict[str, Any]] = []
        for rank in range(world_size):
            path = tmp / rank_record_name(rank)
            if not path.is_file():
                raise CheckpointError(f"rank {rank} of {world_size} has no record {path}: its parts never arrived")
            record = json.loads(path.read_text())
            extras.append(record["extra"])
            for part in record["parts"]:
                files[part["file"]] = {"sha256": part["sha256"], "bytes": part["bytes"], "rank": rank}
                for key, t in part["tensors"].items():
                    name = tensor_name(key)
                    entry = tensors.setdefault(name, TensorEntry(t["dtype"], tuple(t["global_shape"])))
                    if entry.dtype != t["dtype"] or entry.global_shape != tuple(t["global_shape"]):
                        raise CheckpointError(
                            f"tensor {name!r}: rank {rank} saved {t['dtype']} {t['global_shape']} but another rank "
                            f"saved {entry.dtype} {list(entry.global_shape)}")
                    entry.boxes.append(Box(part["file"], tuple(t["offsets"]), tuple(t["shape"]), key))
        if not tensors:  # no trainer saves nothing; a stray client's well-formed but empty save must not become "latest"
            raise CheckpointError(f"step {step}: none of the {world_size} rank(s) saved a tensor: nothing to commit")
        for name, entry in tensors.items():
            check_tiling(name, entry)
        return Manifest(run, step, world_size, files, tensors, extras, created=time.time())

    def commit(self, run: str, step: int, world_size: int) -> Path:
        """Turn a fully staged `step_N.tmp/` into `step_N/` and point `latest` at it; returns the committed path."""
        with self._lock:
            tmp, final = self.tmp_dir(step), self.final_dir(step)
            manifest = self._manifest_from_records(run, step, world_size)
            # A crashed earlier attempt of this step may have left files this one did not rewrite.
            keep_names = set(manifest.files) | {rank_record_name(r) for r in range(world_size)}
            for p in tmp.iterdir():
                if p.name not in keep_names:
                    p.unlink()
            write_durable(tmp / MANIFEST, json.dumps(manifest.to_json(), indent=1).encode())
            fsync_dir(tmp)
            if final.exists():  # the same step saved again (a resumed run): the new save replaces it
                trash = final.with_name(final.name + TRASH_SUFFIX)
                shutil.rmtree(trash, ignore_errors=True)
                os.rename(final, trash)
                shutil.rmtree(trash, ignore_errors=True)
            os.rename(tmp, final)
            fsync_dir(self.root)
            self._point_latest()
            self._retain()
            return final

    def _point_latest(self) -> None:
        steps = self.steps()
        latest = self.root / LATEST
        if steps:
            write_durable(latest.with_name(LATEST + TMP_SUFFIX), (step_dir_name(steps[-1]) + "\n").encode())
            os.replace(latest.with_name(LATEST + TMP_SUFFIX), latest)
            fsync_dir(self.root)
        elif latest.exists():
            latest.unlink()

    # ------------------------------------------------------------ catalogue

    def steps(self) -> list[int]:
        """Committed steps, ascending (a committed directory has a manifest; validity is the loader's business)."""
        return sorted(parse_step(p.name) for p in checkpoint_dirs(self.root) if (p / MANIFEST).is_file())

    def latest_step(self) -> int:
        steps = self.steps()
        return steps[-1] if steps else -1

    def summary(self, step: int, checksums: bool = False) -> CheckpointSummary:
        path = self.final_dir(step)
        if not (path / MANIFEST).is_file():
            raise CheckpointError(f"no committed checkpoint for step {step} in {self.root}")
        keep = (path / KEEP).exists()
        latest = step == self.latest_step()
        try:
            m = verify(path, checksums=checksums)
            size = sum(int(f["bytes"]) for f in m.files.values())
            return CheckpointSummary(step, path, keep, latest, size, m.world_size, True)
        except CheckpointError as e:
            return CheckpointSummary(step, path, keep, latest, 0, 0, False, str(e))

    def list(self, checksums: bool = False) -> list[CheckpointSummary]:
        with self._lock:
            return [self.summary(s, checksums) for s in self.steps()]

    def manifest(self, step: int) -> Manifest:
        return read_manifest(self.final_dir(step))

    def set_keep(self, step: int, keep: bool) -> CheckpointSummary:
        with self._lock:
            path = self.final_dir(step)
            if not (path / MANIFEST).is_file():
                raise CheckpointError(f"no committed checkpoint for step {step} in {self.root}")
            marker = path / KEEP
            if keep:
                write_durable(marker, b"kept by request\n")
            elif marker.exists():
                marker.unlink()
            fsync_dir(path)
            return self.summary(step)

    def delete(self, step: int) -> bool:
        """Remove one checkpoint (kept or not); `latest` moves to the newest remaining one."""
        with self._lock:
            path = self.final_dir(step)
            if not path.exists():
                return False
            # Rename first: a crash mid-delete must not leave a half-removed directory under a committed name.
            trash = path.with_name(path.name + TRASH_SUFFIX)
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(path, trash)
            fsync_dir(self.root)
            shutil.rmtree(trash, ignore_errors=True)
            self._point_latest()
            return True

    def _retain(self) -> None:
        if self.keep_last <= 0:
            return
        steps = self.steps()
        for step in steps[:-self.keep_last]:
            if not (self.final_dir(step) / KEEP).exists():
                log.info("retention: deleting %s (keep_last=%d)", self.final_dir(step), self.keep_last)
                self.delete(step)
