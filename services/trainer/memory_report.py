"""Where a training step's device memory goes: parameters, gradients, optimizer state, activations, and the rest.

    report = measure_step(model, optimizer, lambda: train_one_step(...), device)
    print(report.table())

Categories are counted from the tensors themselves (each storage once), not guessed from the allocator:
- parameters, gradients and optimizer state: every storage behind `model.parameters()`, their `.grad`, and the tensors
  in `optimizer.state`, on `device`, after the step;
- parameter copies: storages saved for backward that are casts of parameters (their autograd history is a dtype copy,
  possibly re-viewed, of a parameter): under autocast or the experts' explicit cast, the bf16 copies of fp32 weights
  that the GEMMs keep for their backward, and the FP8 experts' e4m3 weights (kernels/fp8_grouped_mm.py marks them,
  having made them where autograd records nothing). They scale with the parameters, not with the tokens, so they are not
  counted as activations (for 128 experts they are most of what a step saves). Also counted here: the copies a module
  holds across a step's passes without saving them (`held_weight_copies()`: the FP8 experts inside
  `fp8_weights_held` keep both e4m3 layouts), read when backward starts;
- activations: every other storage the step saved for backward on `device` before backward started (a saved-tensors
  hook around the step; parameters excluded). All of them are alive together then, at the end of the forward pass,
  the usual peak. Tensors that a recompute or offload region keeps elsewhere never reach this hook, which is the point
  of those policies. With several micro-batches per step that is what the first backward finds: one micro-batch's
  (or, under a pipeline schedule, those of the forwards run before it). The later micro-batches' are allocated as
  earlier ones are freed and are not counted again (parameter copies likewise).
On CUDA two allocator readings place them in time: `at_backward` (allocated when backward first reads a saved tensor:
parameters, optimizer state, all activations, no gradients yet with `zero_grad(set_to_none=True)`) and `peak` (the
high-water mark over the step). `other` is what was alive at backward start besides those categories (the loss
path's tensors, buffers, allocator rounding); `peak - at_backward` is what backward added on top (gradients while
activations are still being freed, and its temporaries). The categories are sizes, not all alive at once: gradients
grow as activations are freed, so they need not sum to the peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

GIB = 2**30


def _storage_bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.device != device:
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _optimizer_tensors(optimizer, params) -> list[torch.Tensor]:
    """Optimizer state, less storages that are parameters' own (an fp32 parameter is its own master weight)."""
    own = {p.untyped_storage().data_ptr() for p in params}
    out = []
    for state in getattr(optimizer, "state", {}).values():
        out.extend(v for v in state.values() if isinstance(v, torch.Tensor) and
                   v.untyped_storage().data_ptr() not in own)
    return out


@dataclass
class MemoryReport:
    parameters: int
    gradients: int
    optimizer_state: int
    parameter_copies: int  # casts of parameters saved for backward or held for the step (bf16, e4m3 copies)
    activations: int  # everything else saved for backward
    at_backward: int | None  # allocated when backward started (CUDA only)
    grads_at_backward: int  # gradient bytes already there then (earlier micro-batches; 0 with set_to_none)
    peak: int | None  # allocator high-water mark over the step (CUDA only)

    @property
    def other(self) -> int | None:
        if self.at_backward is None:
            return None
        return (self.at_backward - self.parameters - self.optimizer_state - self.parameter_copies
                - self.activations - self.grads_at_backward)

    def rows(self) -> list[tuple[str, int | None]]:
        return [("parameters", self.parameters), ("optimizer state", self.optimizer_state),
                ("parameter copies (saved or held)", self.parameter_copies),
                ("activations (saved for backward)", self.activations),
                ("other at backward start", self.other),
                ("allocated at backward start", self.at_backward),
                ("gradients", self.gradients),
                ("added by backward (peak - start)", None if self.peak is None else self.peak - self.at_backward),
                ("peak", self.peak)]

    def table(self) -> str:
        lines = []
        for name, value in self.rows():
            if value is None:
                continue
            share = f"{100 * value / self.peak:5.1f}%" if self.peak else ""
            lines.append(f"{name:<44}{value / GIB:9.2f} GiB {share}")
        return "\n".join(lines)


# Autograd nodes that pass one input through as a copy or a view: a saved tensor reached from a parameter through only
# these is that parameter in another dtype or shape.
_COPY_OR_VIEW = {"ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
                 "UnsafeViewBackward0", "AliasBackward0", "SliceBackward0", "SelectBackward0", "ExpandBackward0",
                 "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "ReshapeAliasBackward0"}


def _is_parameter_copy(t: torch.Tensor, params: set[int]) -> bool:
    """True when `t` is a dtype copy (or a view of one) of a parameter, going by its autograd history, or a copy made
    inside an autograd function and marked `is_weight_copy` there (the FP8 experts' e4m3 weights)."""
    if getattr(t, "is_weight_copy", False):
        return True
    node, copied = t.grad_fn, False
    for _ in range(8):  # a cast and a few views; anything longer was computed, not copied
        if node is None:
            return False
        name = type(node).__name__
        if name == "AccumulateGrad":
            return copied and id(node.variable) in params
        if name not in _COPY_OR_VIEW or len(node.next_functions) == 0:
            return False
        copied = copied or name == "ToCopyBackward0"
        node = node.next_functions[0][0]
    return False


def measure_step(model: torch.nn.Module, optimizer, step: Callable[[], object], device: torch.device) -> MemoryReport:
    """Run `step()` (forward, backward and optimizer step) once and report its memory by category on `device`."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    param_ids = {id(p) for p in model.parameters()}
    # storage address -> bytes; no references, so nothing lives longer than it would
    saved: dict[int, int] = {}
    copies: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if not at_backward and t.device == device and storage.data_ptr() not in param_storages:
            into = copies if _is_parameter_copy(t, param_ids) else saved
            into[storage.data_ptr()] = storage.nbytes()
        return t

    on_cuda = device.type == "cuda"
    params = list(model.parameters())
    at_backward: list[tuple[int, int]] = []  # (allocated, gradient bytes) at the first unpack

    def unpack(t: torch.Tensor) -> torch.Tensor:
        if not at_backward:
            allocated = torch.cuda.memory_allocated(device) if on_cuda else 0
            at_backward.append((allocated, _storage_bytes((p.grad for p in params), device)))
            for m in model.modules():
                for held in getattr(m, "held_weight_copies", lambda: [])():
                    if held.device == device:
                        copies[held.untyped_storage().data_ptr()] = held.untyped_storage().nbytes()
        return t

    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        step()
    activations = sum(n for ptr, n in saved.items() if ptr not in copies)
    peak = torch.cuda.max_memory_allocated(device) if on_cuda else None
    allocated, grads_then = at_backward[0] if at_backward else (0, 0)
    return MemoryReport(parameters=_storage_bytes(params, device),
                        gradients=_storage_bytes((p.grad for p in params), device),
                        optimizer_state=_storage_bytes(_optimizer_tensors(optimizer, params), device),
                        parameter_copies=sum(copies.values()), activations=activations,
                        at_backward=allocated if on_cuda else None, grads_at_backward=grads_then, peak=peak)
