"""Activation memory: recompute chosen modules in backward instead of keeping what they save, or keep it on the host.

`apply_memory_policy(model, recompute, offload, recompute_layers, offload_layers)` applies `model.recompute` /
`model.offload` to a built (and, if so, parallelized) model's decoder blocks (all of them, or the layer ids listed in
`model.recompute_layers` / `model.offload_layers`: e.g. recompute only the first layers of a pipeline stage, whose
activations live longest under 1F1B), in place, without changing parameter names: it replaces the chosen modules' `forward` on the
instance. Call it once, after parallelization (context parallelism swaps `attn.core` and this wraps whatever is
there) and after any `copy.deepcopy` of the model (the wrappers hold the module they were applied to).

Two ways to recompute, by what a module's output is used for:
- whole modules ("attn_core", "moe", "layer"): `torch.utils.checkpoint` (non-reentrant). Only the inputs are kept; the
  forward runs again in backward. Side effects that must happen once per step (the router's load count) ask
  `in_recompute()`; values computed from state that later forwards change (the global aux loss's step counts) are
  taken again from the forward being repeated, `same_as_forward`. Context parallelism's attention core is a module
  that reads its micro-batch's layout (bound per micro-batch; by backward another micro-batch's may be bound: pairs,
  1F1B): its forward reads the layout through `same_as_forward`, so a recompute of it ("attn_core") or of its block
  ("layer") repeats the micro-batch it stands for.
- modules whose *output* is what costs memory ("norm", "moe_act", "moe_fc1", "moe_dispatch"): checkpointing them alone
  saves nothing, because the next op (a projection) keeps that output for its own backward. So the output is also
  *discarded from its consumers*: `discard_output(y, recompute)` names it, and inside `dropping_discarded()` any saved
  tensor that is (a view of) y is stored as a recipe and recomputed, once, when backward first needs it. This is what
  memory-efficient SwiGLU does for the [T·k, f] expert activation ("moe_act"); "moe_fc1" does it for the [T·k, 2f]
  output of the experts' first GEMM (one more grouped GEMM in backward, on the bf16 weight copy that GEMM keeps
  anyway), and "moe_dispatch" for the [T·k, h] dispatched rows that GEMM would keep (permuted again from the [T, h]
  layer input: k times fewer bytes kept for one more permutation pass in backward; the local dispatch only, since
  under EP it would repeat the all-to-all). Recipes that need another discarded output get it through `rebuilder`, so
  they chain (all three together keep none of the expert path's [T·k, ·] tensors) without keeping each other's inputs
  alive. Under autocast with fp32 parameters the projections save their own bf16 casts of a norm output, so "norm"
  frees little there; it pays when compute runs in the parameters' dtype.

Offload ("attn", "moe", "layer") runs the module under `torch.autograd.graph.save_on_cpu(pin_memory=True)`: saved
tensors go to pinned host memory as they are saved and come back when backward needs them.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from contextvars import ContextVar
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_RECOMPUTING: ContextVar[bool] = ContextVar("foldmoe_recomputing", default=False)
# The memos of the checkpointed calls running now, outermost first: what `same_as_forward` kept on their forward.
_MEMOS: ContextVar[tuple[dict, ...]] = ContextVar("foldmoe_recompute_memos", default=())


def in_recompute() -> bool:
    """True while a checkpointed forward is being run again in backward."""
    return _RECOMPUTING.get()


def checkpointed(fn: Callable) -> Callable:
    """`fn` under non-reentrant activation checkpointing; its second and later runs see `in_recompute()`."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        calls, memo = [0], {}

        def body(*a, **kw):
            token = _RECOMPUTING.set(calls[0] > 0 or _RECOMPUTING.get())
            memos = _MEMOS.set((*_MEMOS.get(), memo))
            calls[0] += 1
            try:
                return fn(*a, **kw)
            finally:
                _MEMOS.reset(memos)
                _RECOMPUTING.reset(token)

        return checkpoint(body, *args, use_reentrant=False, **kwargs)

    return run


def same_as_forward(key: object, compute: Callable[[], Any]) -> Any:
    """`compute()`, except inside a recompute, where it is what `compute()` returned on the forward being repeated.

    For values that read state the forward also changed (the global aux loss's step statistics: computing them again
    would count the micro-batch twice and see later micro-batches' counts; the context-parallel core's bound layout:
    by backward another micro-batch's is bound). `key`: the calling module, or (module, name). Kept in every
    checkpointed call running, so a nested checkpoint, first run inside an outer recompute, finds the value too."""
    memos = _MEMOS.get()
    if in_recompute():
        found = [m[key] for m in memos if key in m]
        if not found:
            owner = key[0] if isinstance(key, tuple) else key
            raise RuntimeError(f"{type(owner).__name__} is recomputed, but its forward kept no value to reuse: it ran "
                               "outside `recompute.checkpointed`")
        value = found[0]
    else:
        value = compute()
    for m in memos:
        m[key] = value
    return value


def offloaded(fn: Callable) -> Callable:
    """`fn` with the tensors it saves for backward kept in pinned host memory."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return fn(*args, **kwargs)

    return run


# ---------------------------------------------------------------- discarding an output from its consumers


class _Recipe:
    """How to rebuild a discarded output: `fn()` under the autocast state of the original forward, computed once."""

    def __init__(self, fn: Callable[[], torch.Tensor], device_type: str):
        self.fn, self.device_type = fn, device_type
        self.autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        self._value: torch.Tensor | None = None

    def value(self) -> torch.Tensor:
        if self._value is None:
            enabled, dtype = self.autocast
            with torch.no_grad(), torch.autocast(self.device_type, dtype=dtype, enabled=enabled):
                self._value = self.fn()
        return self._value


# storage address of a discarded output -> (weak reference to it, recipe). Entries leave when the output dies, so a
# later tensor at the same address is never mistaken for it.
_DISCARDED: dict[int, tuple[weakref.ref, _Recipe]] = {}


def discard_output(y: torch.Tensor, recompute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Mark `y` so that ops run inside `dropping_discarded()` save a recipe (`recompute()`, which must rebuild y
    exactly, contiguous) instead of y itself. Returns y."""
    if not y.is_contiguous():
        raise ValueError("discard_output needs a contiguous output (its recomputation is re-viewed by offset)")
    key = y.untyped_storage().data_ptr()

    def forget(ref: weakref.ref, table: dict = _DISCARDED) -> None:  # bound now: at exit the global may be gone
        if table.get(key, (None,))[0] is ref:
            del table[key]

    _DISCARDED[key] = (weakref.ref(y, forget), _Recipe(recompute, y.device.type))
    return y


def _find_discarded(t: torch.Tensor):
    if t.layout != torch.strided or not _DISCARDED:
        return None
    entry = _DISCARDED.get(t.untyped_storage().data_ptr())
    if entry is None:
        return None
    y = entry[0]()
    if y is None or y.dtype != t.dtype or y.device != t.device:
        return None
    return entry[1], tuple(t.shape), t.stride(), t.storage_offset() - y.storage_offset()


def rebuilder(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A callable giving `t` later (in a recipe run in backward) that does not hold `t` when `t` is itself a discarded
    output (or a view of one): then it asks that output's recipe, so recipes can chain without keeping their inputs."""
    found = _find_discarded(t)
    if found is None:
        return lambda: t
    recipe, shape, stride, offset = found

    def rebuilt() -> torch.Tensor:
        value = recipe.value()
        return value.as_strided(shape, stride, value.storage_offset() + offset)

    return rebuilt


@contextlib.contextmanager
def dropping_discarded() -> Iterator[None]:
    """Inside: a tensor saved for backward that is (a view of) a `discard_output` is stored as its recipe; any other
    goes to the saved-tensor hooks that were active outside (offload, an enclosing checkpoint), or is kept as is."""
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)

    def pack(t: torch.Tensor):
        found = _find_discarded(t)
        if found is not None:
            return ("recipe", found)
        return ("outer", outer[0](t)) if outer is not None else ("kept", t)

    def unpack(packed):
        kind, payload = packed
        if kind == "recipe":
            recipe, shape, stride, offset = payload
            value = recipe.value()
            return value.as_strided(shape, stride, value.storage_offset() + offset)
        return outer[1](payload) if kind == "outer" else payload

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def _dropping_discarded_around(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with dropping_discarded():
            return fn(*args, **kwargs)

    return run


# ---------------------------------------------------------------- applying a policy to the model


def _recomputed_norm(norm: nn.Module) -> Callable:
    original = norm.forward
    forward = checkpointed(original)

    def run(x: torch.Tensor) -> torch.Tensor:
        y = forward(x)
        return discard_output(y, lambda: original(x)) if y.is_contiguous() else y

    return run


def _recompute_core(attn: nn.Module) -> None:
    """Checkpoint `attn.core`: a function (the single-device core) is wrapped in place; a module (context
    parallelism's) keeps its place among the model's modules (`model.cp_modules` lists it) and has its forward wrapped."""
    if isinstance(attn.core, nn.Module):
        attn.core.forward = checkpointed(attn.core.forward)
    else:
        attn.core = checkpointed(attn.core)


def apply_memory_policy(model: nn.Module, recompute: list[str], offload: list[str],
                        recompute_layers: list[int] | None = None, offload_layers: list[int] | None = None) -> nn.Module:
    """Apply `model.recompute` and `model.offload` (validated by the config) to the decoder blocks of `model`: to those
    whose layer id (the global one, also on a pipeline stage) is in `recompute_layers` / `offload_layers`, or to every
    block when that list is empty or None (`model.recompute_layers`, `model.offload_layers`)."""
    from services.trainer.model.moe.moe_layer import MoELayer

    for layer_id, block in model.layers.items():
        layer = int(layer_id)
        rec = recompute if not recompute_layers or layer in recompute_layers else []
        off = offload if not offload_layers or layer in offload_layers else []
        if "norm" in rec:
            for norm in (block.attn_norm, block.mlp_norm):
                norm.forward = _recomputed_norm(norm)
        if "attn_core" in rec:
            _recompute_core(block.attn)
        if isinstance(block.mlp, MoELayer):
            block.mlp.experts.recompute_activation = "moe_act" in rec
            block.mlp.experts.recompute_fc1 = "moe_fc1" in rec
            block.mlp.recompute_dispatch = "moe_dispatch" in rec
            if block.mlp.recompute_dispatch and not hasattr(block.mlp.dispatcher, "redispatch"):
                raise ValueError(f"recompute 'moe_dispatch' needs a dispatch that can be redone locally; layer "
                                 f"{layer}'s {type(block.mlp.dispatcher).__name__} moves tokens between ranks "
                                 "(parallel.ep or etp > 1), which would repeat its all-to-all in backward; use 'moe' "
                                 "instead")
            if "moe" in rec:
                block.mlp.forward = checkpointed(block.mlp.forward)
        if "norm" in rec:  # the norms' consumers: drop their copies of the norm outputs
            block.attn.forward = _dropping_discarded_around(block.attn.forward)
            block.mlp.forward = _dropping_discarded_around(block.mlp.forward)
        if "attn" in off:
            block.attn.forward = offloaded(block.attn.forward)
        if "moe" in off and isinstance(block.mlp, MoELayer):
            block.mlp.forward = offloaded(block.mlp.forward)
        if "layer" in rec:
            block.forward = checkpointed(block.forward)
        if "layer" in off:
            block.forward = offloaded(block.forward)
    return model
