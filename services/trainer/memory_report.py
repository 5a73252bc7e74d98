"""Where a training step's device memory goes: parameters, gradients, optimizer state, activations, and the rest.

    report = measure_step(model, optimizer, lambda: train_one_step(...), device)
    print(report.table())

Categories are counted from the tensors themselves (each storage once), not guessed from the allocator:
- parameters, gradients and optimizer state: every storage behind `model.parameters()`, their `.grad`, and the tensors
  in `optimizer.state`, on `device`, after the step;
- activations: every storage the step saved for backward on `device` (a saved-tensors hook around the step; parameters
  excluded). All of them are alive together at the end of the forward pass, the usual peak. Tensors that a recompute
  or offload region keeps elsewhere never reach this hook, which is the point of those policies. With several
  micro-batches per step, storages are told apart by address, so a later micro-batch's activations, allocated where
  an earlier one's were freed, count once: roughly one micro-batch's worth, an estimate rather than an exact figure.
On CUDA `peak` is the allocator's high-water mark over the step and `other` the rest of it: temporaries (logits,
the MoE permutation buffers, GEMM workspaces), allocator rounding, and whatever was alive besides the above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

GIB = 2**30


def _storage_bytes(tensors: Iterable[torch.Tensor], device: torch.device, skip: set[int] = frozenset()) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.device != device:
            continue
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    out = []
    for state in getattr(optimizer, "state", {}).values():
        out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out


@dataclass
class MemoryReport:
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    peak: int | None  # allocator high-water mark over the step (CUDA only)

    @property
    def other(self) -> int | None:
        if self.peak is None:
            return None
        return self.peak - self.parameters - self.gradients - self.optimizer_state - self.activations

    def rows(self) -> list[tuple[str, int | None]]:
        return [("parameters", self.parameters), ("gradients", self.gradients),
                ("optimizer state", self.optimizer_state), ("activations (saved for backward)", self.activations),
                ("other (temporaries, workspaces, rounding)", self.other), ("peak", self.peak)]

    def table(self) -> str:
        lines = []
        for name, value in self.rows():
            if value is None:
                continue
            share = f"{100 * value / self.peak:5.1f}%" if self.peak else ""
            lines.append(f"{name:<44}{value / GIB:9.2f} GiB {share}")
        return "\n".join(lines)


def measure_step(model: torch.nn.Module, optimizer, step: Callable[[], object], device: torch.device) -> MemoryReport:
    """Run `step()` (forward, backward and optimizer step) once and report its memory by category on `device`."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}  # storage address -> bytes; no references, so nothing lives longer than it would

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if t.device == device and storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    activations = sum(saved.values())
    peak = torch.cuda.max_memory_allocated(device) if on_cuda else None
    params = list(model.parameters())
    return MemoryReport(parameters=_storage_bytes(params, device),
                        gradients=_storage_bytes((p.grad for p in params), device),
                        optimizer_state=_storage_bytes(_optimizer_tensors(optimizer), device),
                        activations=activations, peak=peak)
