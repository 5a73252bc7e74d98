"""Where the device sat idle in a `run.profile_steps` trace, and what the host and the other streams did meanwhile.

    python3 bench/trace_gaps.py runs/NAME/profile/trace_rank0.json [--min-ms 5]

Prints, from a torch.profiler Chrome trace: each marked step's host range; per CUDA stream its busy time (kernels,
copies, memsets) and its span; every gap of at least `--min-ms` on the busiest stream (the training stream), with the
other streams' work and the host's CUDA calls that overlap it; and every host CUDA call (on any thread) that took at
least `--min-ms` (a blocking wait, allocation or registration shows up there).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--min-ms", type=float, default=5.0)
    args = ap.parse_args()
    events = load(args.trace)
    min_us = args.min_ms * 1e3
    t0 = min(e["ts"] for e in events)

    def ms(t: float) -> str:
        return f"{(t - t0) / 1e3:9.1f}"

    steps = sorted((e for e in events if e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    print("host ranges (ms from the trace's start):")
    for e in steps:
        print(f"  {e['name']:<18} {ms(e['ts'])} .. {ms(e['ts'] + e['dur'])}  ({e['dur'] / 1e3:.1f} ms)")

    by_stream: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") in DEVICE_CATS:
            by_stream[e["args"].get("stream", -1)].append(e)
    print("\ndevice streams:")
    for s, evs in sorted(by_stream.items(), key=lambda kv: -len(kv[1])):
        busy = sum(e["dur"] for e in evs) / 1e3
        first, last = min(e["ts"] for e in evs), max(e["ts"] + e["dur"] for e in evs)
        kinds = defaultdict(float)
        for e in evs:
            kinds[e["cat"]] += e["dur"] / 1e3
        what = ", ".join(f"{k} {v:.1f} ms" for k, v in kinds.items())
        print(f"  stream {s:>4}: {len(evs):6d} events, busy {busy:8.1f} ms over {ms(first)} .. {ms(last)}  ({what})")

    if not by_stream:
        print("  none (a CPU trace)")
        return
    train = max(by_stream, key=lambda s: len(by_stream[s]))
    evs = sorted(by_stream[train], key=lambda e: e["ts"])
    host_calls = [e for e in events if e.get("cat") == "cuda_runtime"]
    print(f"\ngaps >= {args.min_ms} ms on stream {train} (the training stream):")
    end = evs[0]["ts"] + evs[0]["dur"]
    for e in evs[1:]:
        if e["ts"] - end >= min_us:
            g0, g1 = end, e["ts"]
            print(f"  {ms(g0)} .. {ms(g1)}  idle {(g1 - g0) / 1e3:.1f} ms, then {e['name'][:60]}")
            for s, other in by_stream.items():
                if s == train:
                    continue
                busy = sum(overlap(g0, g1, o["ts"], o["ts"] + o["dur"]) for o in other)
                if busy:
                    print(f"      stream {s}: busy {busy / 1e3:.1f} ms of it")
            calls = defaultdict(float)
            for c in host_calls:
                calls[(c["name"], c["tid"])] += overlap(g0, g1, c["ts"], c["ts"] + c["dur"])
            for (name, tid), t in sorted(calls.items(), key=lambda kv: -kv[1])[:5]:
                if t >= min_us / 5:
                    print(f"      host thread {tid}: {name} {t / 1e3:.1f} ms of it")
        end = max(end, e["ts"] + e["dur"])

    print(f"\nhost CUDA calls >= {args.min_ms} ms:")
    for c in sorted(host_calls, key=lambda c: c["ts"]):
        if c["dur"] >= min_us:
            print(f"  {ms(c['ts'])}  {c['dur'] / 1e3:8.1f} ms  thread {c['tid']}  {c['name']}")


if __name__ == "__main__":
    main()
