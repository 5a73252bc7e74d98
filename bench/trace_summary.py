"""Where a profiled step's device time goes: kernel intervals from torch.profiler, summarised per category.

The input is one rank's device kernels as (name, start, end) in µs (torch.profiler events with
`device_type == DeviceType.CUDA`, memcpy/memset included). Two figures come out of it:

- comm: per collective, the time its NCCL kernels run (the union of their intervals: a kernel the profiler reports
  twice, or two transfers of one kind in flight together, count once) and their *exposed* time: the length of the union of that
  collective's kernel intervals minus its overlap with the union of all non-NCCL kernels (compute and copies), i.e. the
  time that collective runs while no compute runs. An NCCL kernel starts when it is launched and ends when its peers
  have all arrived, so exposed time includes waiting for a slower rank. Two collectives running at once are each exposed
  over the shared time, so the per-collective figures can add up to more than `total` (the union of all NCCL kernels
  minus its overlap with compute).
- compute: per kernel category (the keyword table `COMPUTE_KEYS`), the length of the union of its kernel intervals.
  Categories on different streams (a copy beside a GEMM, NCCL beside compute) overlap, so the rows can add up to more
  than the device's busy time (the union of every kernel).
"""

from __future__ import annotations

from typing import Iterable

Interval = tuple[float, float]

COMM_CATEGORIES = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce", "other")
# NCCL kernel names, lower-cased with "_" removed (ncclDevKernel_AllGather_RING_LL, ncclKernel_AllReduce_...,
# ncclDevKernel_SendRecv). all_to_all_single runs as SendRecv kernels, and so do the pipeline's and CP ring's
# isend/irecv, so "all_to_all" holds every point-to-point kernel too.
NCCL_KEYS = {"all_to_all": ("alltoall", "sendrecv"), "all_gather": ("allgather",),
             "reduce_scatter": ("reducescatter",), "all_reduce": ("allreduce",)}

# Compute categories, first match wins, on the lower-cased name with "_" removed. The order matters: the
# memory-efficient SDPA kernels are CUTLASS kernels (fmha_cutlassF_...) and the grouped GEMMs are GEMMs, so attention
# and expert GEMMs are matched before the dense-GEMM catch-all.
COMPUTE_KEYS = (
    # flash / cuDNN / memory-efficient attention, torch's varlen_attn
    ("attention", ("flash", "fmha", "varlen", "attention", "sdpa")),
    # torch._grouped_mm (CUTLASS GroupProblemShape / KernelPtrArray... on sm90) and our Triton _fp8_grouped_mm_kernel
    ("expert GEMM", ("groupedmm", "groupedgemm", "groupproblemshape", "ptrarray")),
    # cuBLAS / cuBLASLt (nvjet_*, sm90_xmma_gemm_*, ampere_*gemm*, splitKreduce) and other CUTLASS GEMMs
    ("dense GEMM", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "splitkreduce")),
    # torch's multi_tensor_apply kernels: fused/foreach AdamW, and also clip_grad_norm's norms and foreach zero/scale
    ("optimizer", ("multitensor", "adam", "foreach")),
    ("memcpy/memset", ("memcpy", "memset")),
)
OTHER_COMPUTE = "elementwise+other"
COMPUTE_CATEGORIES = tuple(c for c, _ in COMPUTE_KEYS) + (OTHER_COMPUTE,)


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points; empty ones (end <= start) dropped, touching ones merged."""
    out: list[Interval] = []
    for s, e in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def total_length(intervals: Iterable[Interval]) -> float:
    """Length of the union: time covered at least once."""
    return sum(e - s for s, e in union(intervals))


def intersection_length(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """Length of union(a) ∩ union(b): time covered by both sets."""
    ua, ub, i, j, total = union(a), union(b), 0, 0, 0.0
    while i < len(ua) and j < len(ub):
        total += max(0.0, min(ua[i][1], ub[j][1]) - max(ua[i][0], ub[j][0]))
        if ua[i][1] < ub[j][1]:  # the interval ending first cannot meet anything later in the other list
            i += 1
        else:
            j += 1
    return total


def exposed_length(comm: Iterable[Interval], compute: Iterable[Interval]) -> float:
    """Time covered by `comm` and not by `compute`."""
    comm = union(comm)
    return total_length(comm) - intersection_length(comm, compute)


def _key(name: str) -> str:
    return name.lower().replace("_", "")


def comm_category(name: str) -> str | None:
    """The collective of an NCCL kernel ("other" for one not in NCCL_KEYS); None for a kernel that is not NCCL's."""
    key = _key(name)
    if "nccl" not in key:
        return None
    return next((c for c, keys in NCCL_KEYS.items() if any(k in key for k in keys)), "other")


def compute_category(name: str) -> str:
    """The COMPUTE_KEYS category of a non-NCCL kernel, OTHER_COMPUTE when no keyword matches."""
    key = _key(name)
    return next((c for c, keys in COMPUTE_KEYS if any(k in key for k in keys)), OTHER_COMPUTE)


def summarize(kernels: Iterable[tuple[str, float, float]]) -> dict[str, dict[str, float]]:
    """One rank's kernels (name, start, end) → µs over the whole trace:
    comm (union of the NCCL kernels' time per collective), exposed (per collective and "total"), compute (union per category),
    device (busy: union of all kernels; comm / compute: union of the NCCL / non-NCCL kernels)."""
    comm: dict[str, list[Interval]] = {c: [] for c in COMM_CATEGORIES}
    compute: dict[str, list[Interval]] = {c: [] for c in COMPUTE_CATEGORIES}
    for name, s, e in kernels:
        cat = comm_category(name)
        (comm[cat] if cat else compute[compute_category(name)]).append((s, e))
    all_comm = union(iv for ivs in comm.values() for iv in ivs)
    all_compute = union(iv for ivs in compute.values() for iv in ivs)
    exposed = {c: exposed_length(ivs, all_compute) for c, ivs in comm.items()}
    exposed["total"] = exposed_length(all_comm, all_compute)
    return {
        "comm": {c: total_length(ivs) for c, ivs in comm.items()},
        "exposed": exposed,
        "compute": {c: total_length(ivs) for c, ivs in compute.items()},
        "device": {"busy": total_length(all_comm + all_compute), "comm": total_length(all_comm),
                   "compute": total_length(all_compute)},
    }
