"""Checkpoint stall per save: the trainer's Snapshotter + a writer subprocess vs a synchronous `torch.save`.

    python bench/bench_checkpoint.py [--gpu-state-gb 22] [--step-ms 111] [--interval 10] [--saves 2]
                                     [--host-buffers 1] [--on-busy wait] [--stage-on-device] [--torch-saves 2]
                                     [--no-transfers] [--dir /tmp/foldmoe-ckbench]

A synthetic training loop holds `--gpu-state-gb` of fp32 state the way AdamW does (parameters, exp_avg, exp_avg_sq:
a third each; gradients come on top) and takes steps of about `--step-ms` (bf16 GEMMs, then a fused AdamW step over
all of it), synchronising at the end of each step as services/trainer/train.py does. Every `--interval` steps it saves
through the real trainer glue (`checkpointing.attach` / `state_shards` / `save`: pinned shared-memory buffers prepared
at start-up, asynchronous device-to-host copies fenced before the next optimizer step) to a real writer subprocess.

What it reports, per save:
- stall: the time the loop lost to the save = time in `save()` + the extra time of the (up to 10) steps after it
  (the fence holds the optimizer step while the copy still runs), against the median step time without saves;
- the device-to-host copy time and GB/s, whether the writer read shared memory or ZMQ frames, save-to-commit time and
  the writer's GB/s (sha256 + fsync included);
- the same state saved by `torch.save` (GPU tensors, so it includes the copy) + fsync: the synchronous stall.
Without CUDA it runs on the CPU with `--cpu-state-gb` (the copy is then a memcpy and nothing overlaps; the loop
skips the AdamW step, so only the save path and the writer are measured).
Redis: REDIS_URL if set, else an embedded redis-server.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.common.config import Config  # noqa: E402
from services.common.registry import Registry  # noqa: E402
from services.trainer import checkpointing  # noqa: E402
from services.trainer.metrics import StepValues  # noqa: E402
from services.trainer.train import MAX_UNREPORTED  # noqa: E402
from services.trainer.step import host_to_device  # noqa: E402

TENSOR_BYTES = 256 << 20
AFTER_STEPS = 10  # steps after a save whose extra time counts as its stall


class SyntheticModel(nn.Module):
    """Parameters of `param_bytes` in 256 MiB tensors (plus a partial last one)."""

    def __init__(self, param_bytes: int, device: torch.device):
        super().__init__()
        sizes = [TENSOR_BYTES // 4] * (param_bytes // TENSOR_BYTES)
        if param_bytes % TENSOR_BYTES:
            sizes.append(param_bytes % TENSOR_BYTES // 4)
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(n, device=device) * 0.01) for n in sizes])


class Loop:
    """Steps of roughly `step_ms`: GEMMs, then AdamW over the whole state (fused on CUDA).

    With `transfers` (the default), each step also moves what a trainer step moves: its micro-batch's tokens from
    pageable host memory to the device at its start (services/trainer/step.py `host_to_device`) and its values to the
    host at its end (services/trainer/metrics.py `StepValues`), and the host waits for the previous step's values
    rather than for the stream, one step behind as the trainer is (further while a save copies, `MAX_UNREPORTED`). Without them the loop drains the stream each step."""

    def __init__(self, state_gb: float, step_ms: float, device: torch.device, transfers: bool = True):
        self.device = device
        self.transfers = transfers and device.type == "cuda"
        self.tokens = torch.randint(0, 150_000, (2 * 4096,))
        self.loss = torch.zeros((), device=device)
        self._pending: deque[StepValues] = deque()
        self.copying = lambda: False  # set to the snapshotter's `copying` once it exists
        self.model = SyntheticModel(int(state_gb * 1e9 / 3), device)
        for p in self.model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=device.type == "cuda")
        self.opt.step()  # creates exp_avg / exp_avg_sq: the state is now params + 2 moments
        n = 4096 if device.type == "cuda" else 512
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.a, self.b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        # Calibrate: the AdamW step is a fixed cost (on an H100 ~20 ms for 22 GB of state), the GEMMs fill the rest.
        self.gemms = 0
        fixed = min(self.step() for _ in range(3))
        self.gemms = 20
        per_gemm = (min(self.step() for _ in range(3)) - fixed) / self.gemms
        self.gemms = max(1, round((step_ms / 1e3 - fixed) / max(per_gemm, 1e-6)))

    def sync(self) -> None:
        """Wait for the training stream only, as the trainer does: a device-wide synchronize would also wait for the
        snapshot's side stream and charge the whole device-to-host copy to the step."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def step(self) -> float:
        """One step, timed from the end of the previous one (which synchronised the training stream, or read the step
        before it: with `transfers` the times are a step late, as the trainer's host clock would be)."""
        start = time.perf_counter()
        if self.transfers:
            host_to_device(self.tokens, self.device)
        for _ in range(self.gemms):
            self.a @ self.b
        if self.device.type == "cuda":  # on 2 CPU cores an AdamW step over the state would dwarf everything else
            self.opt.step()
        if self.transfers:  # as services/trainer/train.py reports steps
            behind = MAX_UNREPORTED if self.copying() else 0
            while self._pending and (len(self._pending) > behind or self._pending[0].ready()):
                self._pending.popleft().read()
            self._pending.append(StepValues(loss=self.loss))
        else:
            self.sync()
        return time.perf_counter() - start

    def state_bytes(self) -> int:
        shards = checkpointing.state_shards(self.model, self.opt, rank=0)
        return sum(s.tensor.numel() * s.tensor.element_size() for s in shards.values())


def start_writer(ckpt: Path, run: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.checkpointer.writer", f"checkpoint.dir={ckpt}",
                             "checkpoint.keep_last=1", f"run.name={run}"], cwd=ROOT, env=env,
                            stderr=subprocess.DEVNULL)


def torch_save_stall(loop: Loop, path: Path) -> float:
    loop.sync()
    start = time.perf_counter()
    with open(path, "wb") as f:
        torch.save({"model": loop.model.state_dict(), "optim": loop.opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def run(args: argparse.Namespace, redis_url: str) -> None:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    state_gb = args.gpu_state_gb if device.type == "cuda" else args.cpu_state_gb
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    run_name = f"bench-{uuid.uuid4().hex[:8]}"
    writer = start_writer(root / "ckpt", run_name, {**os.environ, "REDIS_URL": redis_url})
    try:
        registry = Registry(redis_url, run_name)
        registry.wait_for("checkpointer", timeout=60)
        loop = Loop(state_gb, args.step_ms, device, transfers=not args.no_transfers)
        nbytes = loop.state_bytes()
        cfg = Config()
        cfg.checkpoint.on_busy, cfg.checkpoint.host_buffers = args.on_busy, args.host_buffers
        cfg.checkpoint.stage_on_device = args.stage_on_device
        saver = checkpointing.connect(registry, cfg, rank=0, world_size=1)
        loop.copying = lambda: saver.copying
        t0 = time.perf_counter()
        checkpointing.attach(saver, loop.model, loop.opt, rank=0)  # what the trainer does at start-up
        baseline = [loop.step() for _ in range(args.interval)]  # the buffers are pinned in the background meanwhile
        saver._join_prepare()
        prepare_s = time.perf_counter() - t0
        base = statistics.median(baseline[1:] or baseline)
        data = SimpleNamespace(state=lambda: {"position": 0})
        rows = []
        for save in range(args.saves):
            step_times = []
            stall_call = checkpointing.save(saver, cfg, loop.model, loop.opt, data, step=(save + 1) * args.interval)
            accepted_at = time.perf_counter()
            for _ in range(args.interval):
                step_times.append(loop.step())
            # The fence delays at most the first optimizer steps after the save; a signed sum over a few steps keeps
            # step-time noise from adding up (a sum of positive deviations over hundreds of steps would not).
            extra = max(0.0, sum(t - base for t in step_times[:AFTER_STEPS]))
            rows.append(SimpleNamespace(step=(save + 1) * args.interval, call=stall_call, extra=extra,
                                        copy=saver.last_copy_s, shared=saver.last_shared, accepted_at=accepted_at))
        commit_start = time.perf_counter()
        saver.wait()
        rows[-1].copy, rows[-1].shared = saver.last_copy_s, saver.last_shared  # known once that save was sent
        drain = time.perf_counter() - commit_start
        start = time.perf_counter()  # one save alone, from the call to its commit: the writer's throughput
        checkpointing.save(saver, cfg, loop.model, loop.opt, data, step=(args.saves + 1) * args.interval)
        saver.wait()
        commit_s = time.perf_counter() - start
        saver.close()
    finally:
        writer.send_signal(signal.SIGTERM)
        writer.wait(60)
        shutil.rmtree(root / "ckpt", ignore_errors=True)  # room on the disk for torch.save's copy
    try:
        sync = [torch_save_stall(loop, root / "torch_save.pt") for _ in range(args.torch_saves)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gb = nbytes / 1e9
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\ndevice {name}; state {gb:.2f} GB (fp32 params + AdamW moments) in {len(loop.model.weights) * 3} "
          f"tensors; step {base * 1e3:.1f} ms (median without saves); save every {args.interval} steps; "
          f"on_busy={args.on_busy}, host_buffers={args.host_buffers}, stage_on_device={args.stage_on_device}")
    print(f"host buffers prepared at start-up in {prepare_s:.1f} s (in the background, overlapping the first steps)\n")
    header = (f"{'save@step':>9} | {'save() ms':>9} | {'fence/next steps ms':>19} | {'stall ms':>8} | "
              f"{'% of step':>9} | {'D2H s':>6} | {'D2H GB/s':>8} | handoff")
    print(header)
    print("-" * len(header))
    for r in rows:
        stall = r.call + r.extra
        d2h = f"{r.copy:6.2f} | {gb / r.copy:8.1f}" if r.copy else f"{'-':>6} | {'-':>8}"
        print(f"{r.step:>9} | {r.call * 1e3:9.1f} | {r.extra * 1e3:19.1f} | {stall * 1e3:8.1f} | "
              f"{100 * stall / base:8.1f}% | {d2h} | {'shared memory' if r.shared else 'ZMQ frames'}")
    if sync:
        best = min(sync)
        print(f"{'torch.save':>9} | {best * 1e3:9.1f} | {'':>19} | {best * 1e3:8.1f} | {100 * best / base:8.1f}% | "
              f"synchronous (GPU->CPU + pickle + write + fsync): {gb / best:.2f} GB/s")
    print(f"\nwriter: one save from save() to commit in {commit_s:.2f} s = {gb / commit_s:.2f} GB/s (copy, sha256, "
          f"fsync, atomic commit); the saves above were all committed {drain:.1f} s after the loop ended\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpu-state-gb", type=float, default=22.0, help="params + AdamW moments on the GPU")
    parser.add_argument("--cpu-state-gb", type=float, default=0.6, help="the same without CUDA")
    parser.add_argument("--step-ms", type=float, default=111.0, help="target step time (GEMMs + the AdamW step)")
    parser.add_argument("--interval", type=int, default=10, help="steps between saves")
    parser.add_argument("--saves", type=int, default=2)
    parser.add_argument("--host-buffers", type=int, default=1)
    parser.add_argument("--on-busy", choices=("wait", "skip"), default="wait")
    parser.add_argument("--stage-on-device", action="store_true", help="checkpoint.stage_on_device=true")
    parser.add_argument("--torch-saves", type=int, default=2, help="synchronous torch.save runs to compare (best)")
    parser.add_argument("--no-transfers", action="store_true",
                        help="no per-step batch/values copies; the host drains the stream each step (see Loop)")
    parser.add_argument("--dir", default="/tmp/foldmoe-ckbench")
    args = parser.parse_args()
    url = os.environ.get("REDIS_URL")
    if url:
        run(args, url)
        return
    from services.common.embedded_redis import EmbeddedRedis

    with EmbeddedRedis() as redis:
        run(args, redis.url)


if __name__ == "__main__":
    main()
