"""Resume read rate: a checkpoint read straight from its directory vs through the checkpointer (gRPC Open, ZMQ boxes).

    python bench/bench_resume_load.py [--gb 2] [--ranks 2] [--dir /tmp/foldmoe-loadbench] [--record bench/RESULTS.md]

Writes a checkpoint of `--gb` GB of fp32 tensors (64 MiB each, every one saved as a row split over `--ranks` writing
ranks, as a TP layout saves), then times what a resuming trainer rank does: open the newest checkpoint that verifies
(sha256 of every file) and read every tensor into its place, whole (a one-process layout) and as its `--ranks` row
boxes (each box read by its own rank, one after the other here). Two sources: `load.DirectorySource` (memory-mapped
safetensors slices) and `remote.ServiceSource` against the checkpointer's gRPC service and load socket
(box_server.py) in a process of its own on this machine.
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


def write_checkpoint(root: Path, gb: float, ranks: int) -> tuple[list[str], int]:
    store = CheckpointStore(root, keep_last=0)
    count = max(1, round(gb * 1e9 / (TENSOR_ELEMS * 4)))
    names = [f"model/layers.{i}.weight" for i in range(count)]
    rows = TENSOR_ELEMS // 4096
    for rank in range(ranks):
        g = torch.Generator().manual_seed(rank)
        piece = rows // ranks
        tensors = {n: torch.randn(piece, 4096, generator=g) for n in names}
        boxes = {n: ([rows, 4096], [rank * piece, 0]) for n in names}
        part = store.write_part(1, rank, 0, tensors, boxes)
        store.write_rank_record(1, rank, [part], {"step": 1})
    store.commit("bench", 1, ranks)
    return names, count * TENSOR_ELEMS * 4


def time_reads(source, names: list[str], ranks: int) -> dict[str, float]:
    t0 = time.perf_counter()
    ckpt = source.newest()
    opened = time.perf_counter()
    rows = ckpt.global_shape(names[0])[0]
    whole_sink, box_sink = torch.empty(rows, 4096), torch.empty(rows // ranks, 4096)
    # each box is copied where a restore puts it: a read that maps the file lazily pays for its pages there
    for name in names:
        whole_sink.copy_(ckpt.read(name))
    whole = time.perf_counter()
    for rank in range(ranks):
        for name in names:
            box_sink.copy_(ckpt.read(name, (rank * rows // ranks, 0), (rows // ranks, 4096)))
    boxes = time.perf_counter()
    again = source.newest()
    reopened = time.perf_counter()
    assert again.step == ckpt.step
    return {"open": opened - t0, "whole": whole - opened, "boxes": boxes - whole, "reopen": reopened - boxes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="checkpoint size")
    parser.add_argument("--ranks", type=int, default=2, help="writing ranks; each tensor is split by rows over them")
    parser.add_argument("--dir", default="/tmp/foldmoe-loadbench")
    add_record_argument(parser)
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    names, nbytes = write_checkpoint(root, args.gb, args.ranks)
    server = subprocess.Popen([sys.executable, "-c", SERVE, str(root)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        address, load = server.stdout.readline().split()
        results = {"directory": time_reads(DirectorySource(root), names, args.ranks),
                   "checkpointer": time_reads(ServiceSource(address, load=load), names, args.ranks)}
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(root, ignore_errors=True)
    gb = nbytes / 1e9
    table = Table()
    table.line(f"checkpoint {gb:.2f} GB: {len(names)} fp32 tensors of 64 MiB, each saved as {args.ranks} row pieces")
    table.line(f"{'source':>13} | {'open+verify s':>13} | {'whole GB/s':>10} | {'row boxes GB/s':>14} | {'2nd open s':>10}")
    table.line("-" * 72)
    for what, t in results.items():
        table.line(f"{what:>13} | {t['open']:13.2f} | {gb / t['whole']:10.2f} | {gb / t['boxes']:14.2f} | "
                   f"{t['reopen']:10.3f}")
    table.record(args.record, "Resume read rate: checkpoint directory vs the checkpointer (gRPC Open, ZMQ boxes)")


if __name__ == "__main__":
    main()
