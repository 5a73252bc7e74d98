"""Reading checkpoints: resharding reads, verification, fallback to the newest valid checkpoint.

Specification: a tensor saved in any grid of boxes reads back, in any box, exactly equal to the same box of the
original (this is what lets a new TP/EP/PP layout load an old checkpoint); a flipped byte, a truncated file or a
missing manifest makes `find_latest_valid` skip that checkpoint, logging the file and the reason, and return the
previous one; reading a damaged file gives an error naming it.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.checkpointer.layout import CheckpointError
from services.checkpointer.load import find_latest_valid, load_checkpoint
from services.checkpointer.store import CheckpointStore


def save_grid(store: CheckpointStore, step: int, tensors: dict[str, torch.Tensor], grid: tuple[int, ...]) -> Path:
    """Save each tensor cut into `grid` blocks (one block per rank), as the writer would from that many ranks."""
    ranks = list(itertools.product(*(range(g) for g in grid)))
    for rank, coords in enumerate(ranks):
        pieces, boxes = {}, {}
        for name, t in tensors.items():
            index, offsets = [], []
            for dim, (c, g) in enumerate(zip(coords, grid)):
                size = t.shape[dim] // g
                index.append(slice(c * size, (c + 1) * size))
                offsets.append(c * size)
            pieces[name] = t[tuple(index)].contiguous()
            boxes[name] = (list(t.shape), offsets)
        part = store.write_part(step, rank, 0, pieces, boxes)
        store.write_rank_record(step, rank, [part], {"rank": rank})
    return store.commit("test", step, len(ranks))


def state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"a": torch.randn(12, 10, generator=g), "b": torch.randint(0, 100, (6, 4), generator=g)}


def test_a_2x2_grid_reads_back_in_a_3x1_layout(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=0)
    original = state(1)
    path = save_grid(store, 1, original, (2, 2))
    with load_checkpoint(path) as c:
        assert torch.equal(c.read("a"), original["a"])
        for r in range(3):  # each of 3 new ranks reads its row block, which cuts across the old 2x2 blocks
            assert torch.equal(c.read("a", (4 * r, 0), (4, 10)), original["a"][4 * r:4 * r + 4])
        assert c.extras == [{"rank": r} for r in range(4)]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_box_of_any_grid_equals_the_same_box_of_the_original(tmp_path_factory, data):
    grid = (data.draw(st.sampled_from([1, 2, 3, 6])), data.draw(st.sampled_from([1, 2])))
    store = CheckpointStore(tmp_path_factory.mktemp("grid"), keep_last=0)
    original = torch.arange(36 * 4, dtype=torch.float32).reshape(36, 4)
    path = save_grid(store, 1, {"t": original}, grid)
    lo = [data.draw(st.integers(0, s - 1)) for s in original.shape]
    size = [data.draw(st.integers(0, s - o)) for s, o in zip(original.shape, lo)]
    with load_checkpoint(path, checksums=False) as c:
        got = c.read("t", tuple(lo), tuple(size))
    assert torch.equal(got, original[lo[0]:lo[0] + size[0], lo[1]:lo[1] + size[1]])


def test_read_outside_the_tensor_or_of_an_unknown_name_says_so(tmp_path):
    path = save_grid(CheckpointStore(tmp_path, 0), 1, state(1), (1, 1))
    with load_checkpoint(path) as c:
        with pytest.raises(ValueError, match=r"outside tensor 'a' of global shape \[12, 10\]"):
            c.read("a", (10, 0), (4, 10))
        with pytest.raises(KeyError, match="'nope' is not in checkpoint"):
            c.read("nope")


def damage(path: Path, how: str) -> Path:
    victim = sorted(path.glob("*.safetensors"))[-1]
    data = bytearray(victim.read_bytes())
    if how == "flip":
        data[-3] ^= 0xFF
    elif how == "truncate":
        data = data[:len(data) // 2]
    victim.write_bytes(bytes(data))
    return victim


@pytest.mark.parametrize("how, reason", [("flip", "fails its sha256 check"), ("truncate", "truncated")])
def test_a_damaged_newest_checkpoint_is_skipped_with_the_file_named(tmp_path, caplog, how, reason):
    store = CheckpointStore(tmp_path, keep_last=0)
    save_grid(store, 1, state(1), (2, 1))
    newest = save_grid(store, 2, state(2), (2, 1))
    victim = damage(newest, how)
    with caplog.at_level(logging.WARNING, logger="foldmoe.checkpointer"):
        assert find_latest_valid(tmp_path) == tmp_path / "step_00000001"
    assert str(victim) in caplog.text and reason in caplog.text
    with load_checkpoint(tmp_path / "step_00000001") as c:
        assert torch.equal(c.read("a"), state(1)["a"])
    with pytest.raises(CheckpointError, match=str(victim)):
        load_checkpoint(newest)


def test_reading_a_truncated_file_without_checksums_names_the_file(tmp_path):
    path = save_grid(CheckpointStore(tmp_path, 0), 1, state(1), (2, 1))
    victim = sorted(path.glob("*.safetensors"))[-1]
    victim.write_bytes(victim.read_bytes()[:40])
    with pytest.raises(CheckpointError, match=str(victim)):
        load_checkpoint(path, checksums=False).read("a")  # the size check runs even without checksums


def test_staging_directories_and_uncommitted_saves_are_never_loaded(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=0)
    save_grid(store, 1, state(1), (1, 1))
    part = store.write_part(2, 0, 0, {"a": torch.zeros(2)}, {"a": ([2], [0])})  # step 2 staged, never committed
    store.write_rank_record(2, 0, [part], {})
    (tmp_path / "step_00000003").mkdir()  # a directory under a committed name but without a manifest
    assert find_latest_valid(tmp_path) == tmp_path / "step_00000001"
    assert find_latest_valid(tmp_path / "absent") is None
