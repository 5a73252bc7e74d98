"""Resume read rate: a checkpoint read straight from its directory vs through the checkpointer (gRPC Open, ZMQ boxes).

    python bench/bench_resume_load.py [--gb 2] [--small-gb 0.25] [--ranks 2] [--dir /tmp/foldmoe-loadbench]
                                      [--record bench/RESULTS.md]

Writes a checkpoint of `--gb` GB of fp32 tensors (64 MiB each, every one saved as a row split over `--ranks` writing
ranks, as a TP layout saves) and `--small-gb` GB of small ones (4 KiB to 4 MiB, as many of each size: the norms,
routers and slices of a model cut fine), then times what a resuming trainer rank does: open the newest checkpoint that
verifies (sha256 of every file) and read every tensor into its place, whole (a one-process layout) and as its `--ranks`
row boxes (each box read by its own rank, one after the other here), and every small tensor. Boxes are read one `read`
after another, and (where the reader has it) all in one `read_boxes`, as `load_shards` asks for a rank's boxes. Two
sources: `load.DirectorySource` (memory-mapped safetensors slices) and `remote.ServiceSource` against the
checkpointer's gRPC service and load socket (box_server.py) in a process of its own on this machine.
A second `Open` shows the service verifying a checkpoint once for all ranks.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.record import Table, add_record_argument  # noqa: E402
from services.checkpointer.load import DirectorySource  # noqa: E402
from services.checkpointer.remote import ServiceSource  # noqa: E402
from services.checkpointer.store import CheckpointStore  # noqa: E402

TENSOR_ELEMS = 16 << 20  # 64 MiB of fp32
SERVE = """
import sys, time
from services.checkpointer.box_server import BoxServer
from services.checkpointer.control import serve_grpc
from services.checkpointer.store import CheckpointStore
store = CheckpointStore(sys.argv[1], keep_last=0)
server, address = serve_grpc(store, writer=None)
boxes = BoxServer(store).start()
print(address, boxes.endpoint, flush=True)
time.sleep(3600)
"""


SMALL_ROWS = (1, 4, 16, 64, 256, 1024)  # rows of 1024 fp32: 4 KiB to 4 MiB


def write_checkpoint(root: Path, gb: float, small_gb: float, ranks: int) -> tuple[list[str], list[str]]:
    """The large tensors' names and the small ones'."""
    store = CheckpointStore(root, keep_last=0)
    count = max(1, round(gb * 1e9 / (TENSOR_ELEMS * 4)))
    names = [f"model/layers.{i}.weight" for i in range(count)]
    rounds = max(1, round(small_gb * 1e9 / (sum(SMALL_ROWS) * 4096)))
    small = {f"model/small.{i}.{rows}": rows for i in range(rounds) for rows in SMALL_ROWS}
    rows = TENSOR_ELEMS // 4096
    for rank in range(ranks):
        g = torch.Generator().manual_seed(rank)
        piece = rows // ranks
        tensors = {n: torch.randn(piece, 4096, generator=g) for n in names}
        boxes = {n: ([rows, 4096], [rank * piece, 0]) for n in names}
        if rank == 0:
            tensors.update({n: torch.randn(r, 1024, generator=g) for n, r in small.items()})
            boxes.update({n: ([r, 1024], [0, 0]) for n, r in small.items()})
        part = store.write_part(1, rank, 0, tensors, boxes)
        store.write_rank_record(1, rank, [part], {"step": 1})
    store.commit("bench", 1, ranks)
    return names, list(small)


def read_into(ckpt, boxes: list[tuple], sinks: list[torch.Tensor], together: bool) -> float | None:
    """Seconds to read `boxes` and copy each into its sink (a read that maps the file lazily pays for its pages
    there): one `read` after another, or `together` in one `read_boxes` (None where the reader has none)."""
    if together and not hasattr(ckpt, "read_boxes"):
        return None
    t0 = time.perf_counter()
    boxes_read = ckpt.read_boxes(boxes) if together else (ckpt.read(*box) for box in boxes)
    for sink, box in zip(sinks, boxes_read, strict=True):
        sink.copy_(box)
    return time.perf_counter() - t0


def time_reads(source, names: list[str], small: list[str], ranks: int) -> dict[str, float | None]:
    t0 = time.perf_counter()
    ckpt = source.newest()
    opened = time.perf_counter()
    rows = ckpt.global_shape(names[0])[0]
    whole_sink, box_sink = torch.empty(rows, 4096), torch.empty(rows // ranks, 4096)
    row_boxes = [(name, (rank * rows // ranks, 0), (rows // ranks, 4096)) for rank in range(ranks) for name in names]
    small_boxes = [(name, None, None) for name in small]
    small_sinks = [torch.empty(ckpt.global_shape(name)) for name in small]
    t = {"open": opened - t0,
         "whole": read_into(ckpt, [(name, None, None) for name in names], [whole_sink] * len(names), False),
         "boxes": read_into(ckpt, row_boxes, [box_sink] * len(row_boxes), False),
         "boxes together": read_into(ckpt, row_boxes, [box_sink] * len(row_boxes), True)}
    # The small tensors' pages are mapped (here or by the service) and their sinks touched by a first read, so that
    # neither way of reading pays for that; each is then timed twice, alternately, and the faster kept.
    read_into(ckpt, small_boxes, small_sinks, False)
    for key, together in [("small", False), ("small together", True)] * 2:
        took = read_into(ckpt, small_boxes, small_sinks, together)
        t[key] = took if t.get(key) is None else min(t[key], took)
    reopened = time.perf_counter()
    again = source.newest()
    t["reopen"] = time.perf_counter() - reopened
    assert again.step == ckpt.step
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="size of the large tensors")
    parser.add_argument("--small-gb", type=float, default=0.25, help="size of the small tensors (4 KiB to 4 MiB)")
    parser.add_argument("--ranks", type=int, default=2, help="writing ranks; each tensor is split by rows over them")
    parser.add_argument("--dir", default="/tmp/foldmoe-loadbench")
    add_record_argument(parser)
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    names, small = write_checkpoint(root, args.gb, args.small_gb, args.ranks)
    server = subprocess.Popen([sys.executable, "-c", SERVE, str(root)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        address, load = server.stdout.readline().split()
        results = {"directory": time_reads(DirectorySource(root), names, small, args.ranks),
                   "checkpointer": time_reads(ServiceSource(address, load=load), names, small, args.ranks)}
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(root, ignore_errors=True)
    gb = len(names) * TENSOR_ELEMS * 4 / 1e9
    small_gb = sum(int(n.rsplit(".", 1)[1]) for n in small) * 4096 / 1e9
    rate = lambda size, s: "-" if s is None else f"{size / s:.2f}"  # noqa: E731
    table = Table()
    table.line(f"checkpoint {gb:.2f} GB: {len(names)} fp32 tensors of 64 MiB, each saved as {args.ranks} row pieces; "
               f"{small_gb:.2f} GB: {len(small)} of 4 KiB-4 MiB")
    table.line("GB/s; 'one call': every box asked for in one read_boxes ('-': the reader has none), else one read each")
    table.line(f"{'source':>13} | {'open+verify s':>13} | {'whole':>5} | {'row boxes':>9} | {'one call':>8} | "
               f"{'small boxes':>11} | {'one call':>8} | {'2nd open s':>10}")
    table.line("-" * 105)
    for what, t in results.items():
        table.line(f"{what:>13} | {t['open']:13.2f} | {rate(gb, t['whole']):>5} | {rate(gb, t['boxes']):>9} | "
                   f"{rate(gb, t['boxes together']):>8} | {rate(small_gb, t['small']):>11} | "
                   f"{rate(small_gb, t['small together']):>8} | {t['reopen']:10.3f}")
    table.record(args.record, "Resume read rate: checkpoint directory vs the checkpointer (gRPC Open, ZMQ boxes)")


if __name__ == "__main__":
    main()
