"""Several box requests in flight per rank on the checkpointer's load socket (services/checkpointer/remote.py).

Specification:
- `split_box` cuts a box into sub-boxes of at most the byte limit that tile it end to end in C order;
- a box read through the window (boxes cut into many sub-boxes, WINDOW of them in flight) equals the box read one
  request at a time and the box read from the directory, for tensors of every dtype, 0-d ones, boxes across saved
  pieces and boxes that leave a sub-box of a single element;
- answers are matched to requests by id: a service that answers a window in reverse order gives the same boxes, and the
  rank really had WINDOW requests outstanding;
- the window runs across boxes: boxes asked for in one `read_boxes`, each of one request, come back in order with
  WINDOW requests outstanding, and so do a rank's boxes when `load_shards` restores a model and its optimizer through
  the checkpointer (which restores them as the directory does);
- a failed request among several in flight raises its named error (KeyError for a missing tensor, CheckpointError
  naming a truncated file, and among several boxes the box), and the next read on the same source is served right;
- a caller that leaves a fetch or a `read_boxes` with requests in flight leaves no answer behind for the next one;
- a service that is killed while a window is in flight (of one box's parts, or of many boxes) is a CheckpointError
  within seconds naming the dropped connection; one that stops answering is a CheckpointError naming the timeout.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest
import torch

from bench.bench_resume_load import SERVE  # the checkpointer's gRPC and load socket in a process of their own
from proto import checkpointer_pb2 as pb
from services.checkpointer import remote
from services.checkpointer.box_server import POLL_MS, BoxServer
from services.checkpointer.control import serve_grpc
from services.checkpointer.layout import CheckpointError
from services.checkpointer.load import load_checkpoint
from services.checkpointer.remote import ServiceSource, split_box
from services.checkpointer.store import CheckpointStore
from services.common import grpc_server

ROOT = Path(__file__).resolve().parent.parent


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(40, 33, generator=g),  # saved as two row pieces
        "half": torch.randn(3, 17, 29, generator=g).to(torch.bfloat16),
        "f16": torch.randn(301, generator=g).to(torch.float16),
        "ids": torch.randint(-2**40, 2**40, (13, 11), generator=g),
        "mask": torch.rand(9, 31, generator=g) > 0.5,
        "count": torch.tensor(5, dtype=torch.int64),  # 0-d
    }


def commit(store: CheckpointStore, step: int = 1) -> dict[str, torch.Tensor]:
    state = tensors()
    w = state["w"]
    pieces = [{"w": (w[:25], [0, 0])}, {"w": (w[25:], [25, 0])}]
    pieces[0].update({n: (t, [0] * t.dim()) for n, t in state.items() if n != "w"})
    for rank, mine in enumerate(pieces):
        part = store.write_part(step, rank, 0, {n: t.contiguous() for n, (t, _) in mine.items()},
                                {n: (list(state[n].shape), off) for n, (_, off) in mine.items()})
        store.write_rank_record(step, rank, [part], {"step": step})
    store.commit("window-test", step, 2)
    return state


@pytest.fixture
def small_chunks(monkeypatch):
    """Sub-boxes of at most 256 bytes, 4 in flight: every box here of more than 64 floats streams through the window."""
    monkeypatch.setattr(remote, "CHUNK_BYTES", 256)
    monkeypatch.setattr(remote, "WINDOW", 4)


def serve(tmp_path, box_server=BoxServer):
    store = CheckpointStore(tmp_path / "ckpt", keep_last=0)
    server, address = serve_grpc(store, writer=None)
    boxes = box_server(store).start()
    return store, server, boxes, ServiceSource(address, load=boxes.endpoint)


@pytest.fixture
def served(tmp_path):
    store, server, boxes, source = serve(tmp_path)
    try:
        yield store, source
    finally:
        source.close()
        grpc_server.stop(server, grace=0.5)
        boxes.close()


BOXES = [("w", None, None), ("w", (20, 3), (10, 30)), ("w", (24, 0), (2, 33)), ("half", None, None),
         ("half", (1, 2, 5), (2, 15, 24)), ("f16", (0,), (301,)), ("f16", (300,), (1,)), ("ids", (2, 1), (11, 10)),
         ("mask", None, None), ("count", None, None), ("w", (7, 0), (0, 33))]


def test_sub_boxes_tile_the_box_in_c_order_within_the_byte_limit():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        shape = tuple(int(s) for s in torch.randint(0, 7, (int(torch.randint(0, 5, (), generator=g)),), generator=g))
        offsets = tuple(int(o) for o in torch.randint(0, 3, (len(shape),), generator=g))
        itemsize, limit = int(torch.randint(1, 9, (), generator=g)), int(torch.randint(8, 200, (), generator=g))
        whole = torch.arange(math.prod(o + s for o, s in zip(offsets, shape))).reshape([o + s for o, s in
                                                                                       zip(offsets, shape)])
        box = whole[tuple(slice(o, o + s) for o, s in zip(offsets, shape))]
        parts = split_box(offsets, shape, itemsize, limit)
        assert all(math.prod(s) * itemsize <= max(limit, itemsize) for _, s in parts)
        pieces = [whole[tuple(slice(o, o + s) for o, s in zip(lo, size))].reshape(-1) for lo, size in parts]
        assert torch.equal(torch.cat(pieces) if pieces else torch.empty(0), box.reshape(-1)), (offsets, shape)


def test_boxes_read_through_the_window_equal_those_read_one_at_a_time_and_from_the_directory(
        served, small_chunks, monkeypatch):
    store, source = served
    commit(store)
    remote_ckpt = source.newest()
    windowed = [remote_ckpt.read(name, offsets, shape) for name, offsets, shape in BOXES]
    monkeypatch.setattr(remote, "CHUNK_BYTES", 1 << 40)
    monkeypatch.setattr(remote, "WINDOW", 1)
    one_at_a_time = [remote_ckpt.read(name, offsets, shape) for name, offsets, shape in BOXES]
    with load_checkpoint(store.final_dir(1)) as local:
        for (name, offsets, shape), got, alone in zip(BOXES, windowed, one_at_a_time):
            want = local.read(name, offsets, shape)
            assert got.dtype == alone.dtype == want.dtype and torch.equal(got, want) and torch.equal(alone, want), \
                (name, offsets, shape)
    assert len(split_box((0, 0), (40, 33), 4, 256)) > 4 * 4  # the big boxes above took several windows


class Reversing(BoxServer):
    """Answers each batch of requests that arrive together in reverse order, and records the batches' sizes."""

    def __init__(self, store: CheckpointStore):
        super().__init__(store)
        self.batches: list[int] = []

    def _serve(self) -> None:
        while not self._stop.is_set():
            batch = []
            while self.sock.poll(50 if batch else POLL_MS):  # what the rank has in flight arrives within 50 ms
                batch.append(self.sock.recv_multipart(copy=False))
            if batch:
                self.batches.append(len(batch))
            for identity_frame, *frames in reversed(batch):
                self.sock.send_multipart([identity_frame, *self._answer(frames)], copy=False)


def test_answers_out_of_order_are_matched_to_their_requests_by_id(tmp_path, small_chunks):
    store, server, boxes, source = serve(tmp_path, Reversing)
    try:
        state = commit(store)
        ckpt = source.newest()
        assert torch.equal(ckpt.read("w"), state["w"])
        assert torch.equal(ckpt.read("half", (1, 2, 5), (2, 15, 24)), state["half"][1:, 2:17, 5:])
        assert max(boxes.batches) == remote.WINDOW  # a full window was outstanding, answered last to first
    finally:
        source.close()
        grpc_server.stop(server, grace=0.5)
        boxes.close()


ROWS = [("w", (i, 0), (1, 33)) for i in range(40)]  # 132 bytes each: one request per box, even in small_chunks


def test_boxes_asked_for_together_keep_a_window_in_flight_across_boxes(tmp_path):
    store, server, boxes, source = serve(tmp_path, Reversing)
    try:
        commit(store)
        ckpt = source.newest()
        got = list(ckpt.read_boxes(BOXES + ROWS))
        with load_checkpoint(store.final_dir(1)) as local:
            for (name, offsets, shape), box in zip(BOXES + ROWS, got, strict=True):
                want = local.read(name, offsets, shape)
                assert box.dtype == want.dtype and torch.equal(box, want), (name, offsets, shape)
        assert all(len(ckpt._plan(*box).parts) == 1 for box in BOXES + ROWS)  # each box one request
        assert max(boxes.batches) == remote.WINDOW  # small boxes, answered last to first, a full window at a time
    finally:
        source.close()
        grpc_server.stop(server, grace=0.5)
        boxes.close()


def test_a_restore_through_the_checkpointer_keeps_a_window_across_its_boxes_and_equals_the_directorys(tmp_path):
    from parallel_harness import save_step_one, tiny_config, trained_one_step

    from services.trainer.parallel.checkpoint_shards import load_shards, training_shards
    from services.trainer.parallel.groups import single_process

    cfg = tiny_config()
    one = single_process(cfg)
    model, opt = trained_one_step(cfg, one, seed=5)
    store, server, boxes, source = serve(tmp_path, Reversing)
    try:
        save_step_one(str(store.root), 0, 1, training_shards(model, opt, one))
        restored = []
        for ckpt in (load_checkpoint(store.final_dir(1)), source.newest()):
            fresh, fresh_opt = trained_one_step(cfg, one, seed=11)
            load_shards(ckpt, fresh, fresh_opt, one)
            restored.append((fresh, fresh_opt))
        for fresh, fresh_opt in restored:
            assert fresh_opt.step_count == opt.step_count
            for b, c in zip(opt.buckets, fresh_opt.buckets, strict=True):
                for key in ("params", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(getattr(b, key), getattr(c, key)), key
        assert max(boxes.batches) == remote.WINDOW  # every tensor of the tiny model is one request
    finally:
        source.close()
        grpc_server.stop(server, grace=0.5)
        boxes.close()


def test_a_one_process_restore_through_the_checkpointer_keeps_a_window_across_its_tensors(tmp_path):
    """One rank (no parallel groups; `checkpointing._restore_whole`): the model's tensors and then the optimizer's,
    each group in one `read_boxes`, restore what the directory restores, bf16 parameters' remainders included."""
    from parallel_harness import save_step_one
    from test_checkpointer_glue import tiny, train_step

    from services.trainer import checkpointing

    model, opt = tiny("bf16")
    train_step(model, opt, 0)
    store, server, boxes, source = serve(tmp_path, Reversing)
    try:
        save_step_one(str(store.root), 0, 1, checkpointing.state_shards(model, opt, rank=0))
        for ckpt in (load_checkpoint(store.final_dir(1)), source.newest()):
            fresh, fresh_opt = tiny("bf16")
            checkpointing._restore_whole(ckpt, "step 1", set(ckpt.names()), fresh, fresh_opt)
            for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
                assert torch.equal(fresh_opt.master_value(q), opt.master_value(p)), name
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    assert torch.equal(fresh_opt.state[q][key].float(), opt.state[p][key].float()), (name, key)
        assert max(boxes.batches) == remote.WINDOW  # every tensor of the tiny model is one request
    finally:
        source.close()
        grpc_server.stop(server, grace=0.5)
        boxes.close()


def test_a_failed_request_among_several_in_flight_names_its_cause_and_the_next_read_works(served, small_chunks):
    store, source = served
    state = commit(store)
    ckpt = source.newest(checksums=False)
    requests = [pb.LoadRequest(step=1, name=n, offsets=[i, 0], shape=[1, 33]) for i, n in
                enumerate(["w", "w", "nope", "w", "w", "w"])]
    with pytest.raises(KeyError, match="'nope' is not in checkpoint"):
        list(source.fetch(requests))
    assert torch.equal(ckpt.read("w", (0, 0), (25, 33)), state["w"][:25])
    # a file the service cannot read (not opened by it yet): the box from it fails among boxes from the other file
    rank1 = next(store.final_dir(1).glob("rank00001_*.safetensors"))
    rank1.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=r"reading 'w' of step 1 failed: .*rank00001.*corrupt or truncated"):
        ckpt.read("w", (20, 0), (20, 33))
    assert torch.equal(ckpt.read("w", (0, 0), (25, 33)), state["w"][:25])
    assert torch.equal(ckpt.read("half"), state["half"])
    # among boxes asked for together: the box whose file is corrupt is named, the boxes before it came through
    got = []
    with pytest.raises(CheckpointError, match=r"reading 'w' \(box 26 of 40\) of step 1 failed: .*rank00001.*corrupt"):
        got.extend(ckpt.read_boxes(ROWS))
    assert torch.equal(torch.cat(got), state["w"][:25])
    with pytest.raises(KeyError, match="'nope' is not in checkpoint"):  # before any request
        next(ckpt.read_boxes(ROWS[:3] + [("nope", None, None)]))
    assert torch.equal(torch.cat(list(ckpt.read_boxes(ROWS[:25] + [("half", None, None)]))[:25]), state["w"][:25])


def test_leaving_a_fetch_with_requests_in_flight_leaves_nothing_for_the_next(served, small_chunks):
    store, source = served
    state = commit(store)
    ckpt = source.newest()
    requests = [pb.LoadRequest(step=1, name="w", offsets=[i, 0], shape=[1, 33]) for i in range(40)]
    for _ in source.fetch(requests):
        break  # three requests still in flight: the fetch closes its socket
    assert source._boxes is None
    assert torch.equal(ckpt.read("w"), state["w"]) and torch.equal(ckpt.read("ids"), state["ids"])
    with closing(ckpt.read_boxes(ROWS)) as rows:
        assert torch.equal(next(rows), state["w"][:1])  # the rows after it in flight: closing closes the socket
    assert source._boxes is None
    assert torch.equal(ckpt.read("w"), state["w"]) and torch.equal(ckpt.read("ids"), state["ids"])



@pytest.mark.parametrize("reading", ["one box in parts", "many boxes"])
def test_a_service_killed_with_a_window_in_flight_is_a_prompt_error_naming_the_dropped_connection(
        tmp_path, small_chunks, reading):
    store = CheckpointStore(tmp_path / "ckpt", keep_last=0)
    commit(store)
    service = subprocess.Popen([sys.executable, "-c", SERVE, str(store.root)], cwd=ROOT, stdout=subprocess.PIPE,
                               text=True)
    try:
        address, load = service.stdout.readline().split()
        with ServiceSource(address, load=load) as source:
            ckpt = source.newest()
            ckpt.read("count")  # connected
            os.kill(service.pid, signal.SIGSTOP)  # the window's requests wait in its socket, unanswered
            failed: list[BaseException] = []
            read = (lambda: ckpt.read("w")) if reading == "one box in parts" else (lambda: list(ckpt.read_boxes(ROWS)))
            reader = threading.Thread(target=lambda: _catch(failed, read))
            reader.start()
            time.sleep(0.5)
            assert reader.is_alive()
            service.kill()
            t0 = time.monotonic()
            reader.join(timeout=30)
            assert not reader.is_alive() and time.monotonic() - t0 < 10
            assert isinstance(failed[0], CheckpointError)
            assert "closed the connection with 4 request(s) unanswered; the checkpointer stopped" in str(failed[0])
    finally:
        service.kill()
        service.wait()


def _catch(failed: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - handed to the test's thread
        failed.append(e)


class Silent(BoxServer):
    """Takes requests and never answers (a host that froze): its connection stays up."""

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(POLL_MS):
                self.sock.recv_multipart()


@pytest.mark.parametrize("reading", ["one box in parts", "many boxes"])
def test_a_service_that_stops_answering_is_an_error_naming_the_timeout(tmp_path, small_chunks, monkeypatch, reading):
    store, server, boxes, source = serve(tmp_path, Silent)
    monkeypatch.setattr(remote, "CALL_TIMEOUT_S", 1.0)
    try:
        commit(store)
        ckpt = source.newest()
        t0 = time.monotonic()
        with pytest.raises(CheckpointError, match=r"load socket tcp://.* did not answer within 1s \(4 request\(s\) "
                                                  r"in flight\); is the checkpointer running"):
            ckpt.read("w") if reading == "one box in parts" else list(ckpt.read_boxes(ROWS))
        assert time.monotonic() - t0 < 5
    finally:
        source.close()
        grpc_server.stop(server, grace=0.5)
        boxes.close()
