"""Which training-stream operations wait behind a checkpoint's bulk device-to-host copy on a side stream (CUDA only).

    python3 bench/bench_copy_engine.py

An 8.6 GB state is copied to pinned host memory on a side stream (into a registered shared-memory arena as the
snapshotter's, or into cudaHostAlloc memory), queued all at once or 64 MB at a time with two chunks in flight, straight
or through a device staging buffer. 20 ms into each copy one small operation is issued on the default stream; each row
prints how long it took to complete (and how long issuing it held the host). What services/checkpointer/snapshot.py
and services/trainer/metrics.py were changed for (bench/RESULTS.md): small device-to-host copies wait for the whole
bulk copy however it is queued; kernels and host-to-device copies do not (except a kernel's first launch, which loads
its module and waits).
"""
import sys, threading, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch
from services.common.host_memory import HostArena, TensorSpec

dev = torch.device("cuda")
N, SZ = 32, 64 << 20  # 32 x 256 MB fp32 = 8.6 GB
state = [torch.randn(SZ, device=dev) for _ in range(N)]
staging = [torch.empty_like(t) for t in state]
arena = HostArena({f"t{i}": TensorSpec.of(t) for i, t in enumerate(state)}, pin=True, shared=True, tag="probe-")
host_reg = [arena.views[f"t{i}"] for i in range(N)]
host_alloc = [torch.empty(SZ, pin_memory=True) for _ in range(N)]
side = torch.cuda.Stream()
x = torch.zeros(1024, device=dev)
small_pinned = torch.zeros(1024, pin_memory=True)
pageable = torch.randint(0, 100, (8192,))
CHUNK = 64 << 20

def bulk(mode, dst):
    src = state
    side.wait_stream(torch.cuda.current_stream())
    if mode.startswith("staged"):
        with torch.cuda.stream(side):
            for s, t in zip(staging, state):
                s.copy_(t, non_blocking=True)
        src = staging
    done = threading.Event()
    if mode.endswith("all"):
        with torch.cuda.stream(side):
            for d, s in zip(dst, src):
                d.copy_(s, non_blocking=True)
            ev = torch.cuda.Event(); ev.record(side)
        def waiter():
            ev.synchronize(); done.set()
        threading.Thread(target=waiter).start()
    else:
        def chunker():
            prev = None
            with torch.cuda.stream(side):
                for d, s in zip(dst, src):
                    db, sb = d.view(torch.uint8), s.view(torch.uint8)
                    for lo in range(0, db.numel(), CHUNK):
                        db[lo:lo + CHUNK].copy_(sb[lo:lo + CHUNK], non_blocking=True)
                        ev = torch.cuda.Event(); ev.record(side)
                        if prev is not None: prev.synchronize()
                        prev = ev
                prev.synchronize()
            done.set()
        threading.Thread(target=chunker).start()
    return done

def probe(kind):
    t0 = time.perf_counter()
    if kind == "kernel": x.add_(1)
    elif kind == "d2h_pinned": small_pinned.copy_(x, non_blocking=True)
    elif kind == "d2h_to_cpu": x.to("cpu", non_blocking=True)
    elif kind == "h2d_pinned": x.copy_(small_pinned, non_blocking=True)
    elif kind == "pin+h2d": pageable.pin_memory().to(dev, non_blocking=True)
    ev = torch.cuda.Event(); ev.record()
    t1 = time.perf_counter()
    ev.synchronize()
    return (t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3

for dst_name, dst in (("registered", host_reg), ("hostalloc", host_alloc)):
    for mode in ("direct-all", "direct-chunk", "staged-all", "staged-chunk"):
        row = []
        for kind in ("kernel", "d2h_pinned", "d2h_to_cpu", "h2d_pinned", "pin+h2d"):
            torch.cuda.synchronize()
            t = time.perf_counter()
            done = bulk(mode, dst)
            time.sleep(0.02)
            issue, lat = probe(kind)
            done.wait()
            total = (time.perf_counter() - t) * 1e3
            row.append(f"{kind} {lat:6.1f} (issue {issue:5.1f})")
        print(f"{dst_name:10s} {mode:13s} bulk~{total:5.0f} ms | " + " | ".join(row), flush=True)
arena.close()
