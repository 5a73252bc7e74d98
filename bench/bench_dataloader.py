"""How many micro-batches per second one dataloader service sustains to N trainer ranks.

    python bench/bench_dataloader.py [--ranks 8] [--micro-batch-size 8] [--seq-len 4096] [--steps 40]

One service in this process; each rank is a separate client process pulling whole steps (grad_accum=1, one dp rank per
client, so every micro-batch is distinct and the service packs all of them). The corpus defaults to the Python standard
library's top-level modules (~5 MB of real text on every machine), tokenized byte-level. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.common.config import load_config  # noqa: E402
from services.dataloader.client import DataClient  # noqa: E402
from services.dataloader.server import DataLoaderServer  # noqa: E402


def _rank(zmq_ep: str, grpc_ep: str, dp_rank: int, dp_size: int, steps: int, warmup: int, prefetch: int, out) -> None:
    client = DataClient(zmq_ep, grpc_ep, dp_rank=dp_rank, dp_size=dp_size, grad_accum=1, rank=dp_rank,
                        prefetch=prefetch, timeout=120)
    for _ in range(warmup):
        client.next_step()
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        tokens += sum(int(mb["tokens"].numel()) for mb in client.next_step())
    out.put((dp_rank, time.perf_counter() - t0, tokens))
    client.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--packing-window", type=int, default=256)
    p.add_argument("--corpus", default=os.path.join(os.path.dirname(os.__file__), "*.py"))
    p.add_argument("--dataset-dir", default="runs/bench-dataloader-data")
    a = p.parse_args()
    cfg = load_config(None, [f"data.corpus=[{a.corpus}]", f"data.dataset_dir={a.dataset_dir}",
                             f"data.seq_len={a.seq_len}", f"data.micro_batch_size={a.micro_batch_size}",
                             "data.grad_accum=1", f"data.prefetch={a.prefetch}",
                             f"data.packing_window={a.packing_window}"])
    server = DataLoaderServer(cfg).start()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(server.zmq_endpoint, server.grpc_endpoint, r, a.ranks, a.steps, a.warmup,
                                             a.prefetch, out)) for r in range(a.ranks)]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    wall = max(r[1] for r in results)
    micro = a.ranks * a.steps
    status = server.engine.status()
    server.stop()
    print(json.dumps({
        "ranks": a.ranks, "micro_batch": f"{a.micro_batch_size}x{a.seq_len}", "steps": a.steps,
        "micro_batches_per_s": round(micro / wall, 1), "tokens_per_s": round(sum(r[2] for r in results) / wall),
        "per_rank_steps_per_s": round(a.steps / wall, 2), "packing_efficiency": round(status.efficiency, 4),
        "documents": sum(len(d) for d in server.datasets), "cpu_cores": os.cpu_count()}))


if __name__ == "__main__":
    main()
