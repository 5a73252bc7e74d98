"""Model build per rank: the trainer's way (parameters on the meta device, cut to the rank's layout, then only its own
slices initialised) against building and initialising the whole model on every rank and slicing it.

    torchrun --standalone --nproc_per_node=2 bench/bench_model_build.py --way meta --config \
        configs/qwen3_30b_a3b.yaml model.num_layers=2 parallel.ep=2 [--record bench/RESULTS.md]
    ... --way whole ...

One way per run (a process's peak resident memory only grows). Rank 0 prints the slowest rank's build time and the
largest peak resident host memory (RSS) of any rank, and the parameters a rank holds against the whole model's.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.record import Table, add_record_argument  # noqa: E402
from services.common.config import load_config  # noqa: E402
from services.trainer.model.initial_weights import parameters_on_meta  # noqa: E402
from services.trainer.model.transformer import MoETransformer  # noqa: E402
from services.trainer.parallel.groups import init_groups  # noqa: E402
from services.trainer.parallel.parallelize import parallelize  # noqa: E402
from services.trainer.train import build_model, init_runtime  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--way", choices=("meta", "whole"), required=True)
    add_record_argument(ap)
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    rt = init_runtime(cfg)
    groups = init_groups(cfg, rt.world_size, rt.rank)
    with parameters_on_meta():
        total = sum(p.numel() for p in MoETransformer(cfg.model).parameters())
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (ru_maxrss is in KiB on Linux)
    t0 = time.perf_counter()
    if args.way == "meta":
        model = build_model(cfg, rt, groups)
    else:
        model = MoETransformer(cfg.model)
        model.init_weights(cfg.run.seed)
        if rt.world_size > 1:
            parallelize(model, cfg, groups)
        model.to(rt.device)
    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)
    figures = torch.tensor([time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                            rss0], dtype=torch.float64, device=rt.device)
    held = sum(p.numel() for p in model.parameters())
    if rt.world_size > 1:
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    if rt.rank == 0:
        build_s, peak, before = figures.tolist()
        table = Table()
        table.line(f"way    ranks  whole model  rank 0 holds  build s (slowest rank)  peak RSS GiB (before build)")
        table.line(f"{args.way:<6} {rt.world_size:>5}  {total / 1e9:9.2f} B  {held / 1e9:10.2f} B  {build_s:22.1f}  "
                   f"{peak:12.2f} ({before:.2f})")
        table.record(args.record, f"Model build per rank, {args.way}: {' '.join(args.overrides)}")
    if rt.world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
