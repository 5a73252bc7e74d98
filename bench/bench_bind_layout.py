"""Host time of binding a micro-batch's context-parallel layout: `context_parallel.bind_layout` (pre-training's
`bind_micro_batch` before every micro-batch forward and, with `parallel.ep_overlap`, at every switch of a pair; RL's
`PolicyBinding.bind` likewise) and RL's `folded.needs_folded_forward` (every micro-batch's log-prob pass).

    python bench/bench_bind_layout.py [--config configs/qwen3_30b_a3b.yaml] [--layers 4 48] [--calls 2000]
        [--record PATH]

The model is built on the meta device (no weights: the host work depends only on its modules), whole, once as it is
and once with its attention cores swapped for the context-parallel ones (`apply_context_parallel`). A CP model binds
a new size-2 layout at every call, as consecutive micro-batches of static CP do (one group), and, as dynamic CP's may,
a size-2 layout and None (a micro-batch of CP size 1) in turn. Per call: the median (and the 10th-90th percentile
range) in microseconds of `--calls` calls each timed alone. Also `model.moe_layers()` (RL's `PolicyBinding` takes it
once per policy forward; pre-training once per step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record import Table, add_record_argument  # noqa: E402
from services.common.config import load_config  # noqa: E402
from services.trainer.model.initial_weights import parameters_on_meta  # noqa: E402
from services.trainer.model.transformer import MoETransformer  # noqa: E402
from services.trainer.parallel.context_parallel import CPLayout, apply_context_parallel, bind_layout  # noqa: E402
from services.trainer.rl.folded import needs_folded_forward  # noqa: E402


def per_call_us(fn, calls: int) -> tuple[float, float, float]:
    """(median, 10th, 90th percentile) of `calls` timed calls of `fn`, in microseconds, after a warm-up."""
    for _ in range(min(calls, 100)):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    deciles = statistics.quantiles(times, n=10)
    return statistics.median(times), deciles[0], deciles[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/qwen3_30b_a3b.yaml")
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 48])
    ap.add_argument("--calls", type=int, default=2000)
    add_record_argument(ap)
    args = ap.parse_args()
    cpu = torch.device("cpu")
    group = object()  # stands for the CP group: binding only hands it to the routers

    def cut(size: int) -> CPLayout:  # a micro-batch's layout; only its group and size are read when binding
        return CPLayout(group, 0, size, torch.zeros(64, dtype=torch.int64))

    table = Table()
    table.line(f"{args.config}, {args.calls} calls; per call, median us (p10-p90)")
    table.line(f"{'layers':>6} {'modules':>7} {'model':<6} {'call':<52} {'median':>8} {'p10-p90':>13}")
    for layers in args.layers:
        cfg = load_config(args.config, [f"model.num_layers={layers}"])
        for cp in (False, True):
            with parameters_on_meta():
                model = MoETransformer(cfg.model)
            if cp:
                apply_context_parallel(model)
            modules = sum(1 for _ in model.modules())
            uncut = SimpleNamespace(cp_layout=None)  # an RL micro-batch of CP size 1 (not cut), not a filler
            static = [cut(2) for _ in range(2)]  # consecutive micro-batches of static CP: new layouts, one group
            dynamic = [cut(2), None]  # dynamic CP: a micro-batch cut over 2 ranks, then one of CP size 1
            turn = [0]

            def bind(layouts):
                turn[0] += 1
                bind_layout(model, layouts[turn[0] % len(layouts)], cpu)

            calls = [("bind_layout, static CP (size 2, a new layout per call)", lambda: bind(static)),
                     ("bind_layout, dynamic CP (size 2 and 1 alternating)", lambda: bind(dynamic))] if cp else \
                [("bind_layout (None: local attention)", lambda: bind([None]))]
            calls.append(("needs_folded_forward (an uncut micro-batch)", lambda: needs_folded_forward(model, uncut)))
            calls.append(("model.moe_layers()", model.moe_layers))
            for name, fn in calls:
                med, p10, p90 = per_call_us(fn, args.calls)
                table.line(f"{layers:>6} {modules:>7} {'CP' if cp else 'no CP':<6} {name:<52} {med:>8.1f} "
                           f"{f'{p10:.1f}-{p90:.1f}':>13}")
            bind_layout(model, None, cpu)
    table.record(args.record, "bind_layout and needs_folded_forward, host time per call")


if __name__ == "__main__":
    main()
