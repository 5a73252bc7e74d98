"""The dense linears in FP8 on CUDA through Transformer Engine (config `model.fp8`); nn.Linear everywhere else.

`FP8Linear` is an `nn.Linear` that owns its `weight` (and `bias`, Qwen2's q/k/v only) exactly as nn.Linear does: same
name, shape and state_dict key, so checkpoints, HF export, the optimizer, the weight gather and tensor parallelism
(which replaces `weight` with its shard in place) see no difference. Only the matmul changes, and only when all three
hold: `fp8` is set, the input is a CUDA tensor, and `transformer_engine` imports. Otherwise it is `F.linear`, bit for
bit.

What runs in FP8 (TE's `Linear` does all three GEMMs of a linear layer in FP8): forward (y = x Wᵀ), dgrad (dx = dy W)
and wgrad (dW = dyᵀ x), on operands TE quantises each call from the high-precision tensors (the fp32 master weight as it
is: no bf16 copy kept), with outputs in the autocast dtype and the weight gradient cast to the parameter's dtype by
autograd. Recipes:
- "tensorwise": TE's `Float8CurrentScaling` — one scale per tensor computed from that tensor's current amax (no amax
  history: stateless, so nothing to checkpoint), e4m3 for activations and weights, e5m2 for gradients (TE's HYBRID).
- "blockwise": TE's `Float8BlockScaling` (DeepSeek-V3) — 1x128 blocks for activations and gradients, 128x128 for
  weights, e4m3 throughout, split accumulation. Needs compute capability 9.0 and CUDA >= 12.9 (TE checks; the error
  names the reason). Also stateless.
What stays in higher precision: the router (fp32 scores), every norm, the attention core (softmax(QKᵀ)V), the embedding
and the output layer with its loss. The routed experts have their own FP8 path (kernels/fp8_grouped_mm.py, no TE).

How TE is used: TE 2.x has no public functional linear that takes the weight as an argument (`te.ops.BasicLinear`'s
functional forward is private), and `te.Linear` owns its weight and adds `_extra_state` to a state_dict. So each
FP8Linear keeps, outside its module tree (a plain attribute, not a submodule: invisible to `state_dict`,
`parameters`, `modules`), a `te.Linear` built on the meta device (it allocates nothing) whose `weight` is rebound to
this layer's own Parameter before each call; TE reads the weight through that attribute, and autograd delivers dW to
our Parameter. The TE module is rebuilt if the weight's shape changes (tensor-parallel sharding). Each call enters
`te.autocast` with the recipe around the TE module only, so the recipe never leaks into the router, norms or output
layer.

Tensor parallelism: the project's TP (services/trainer/parallel/tensor_parallel.py) shards these layers in place and
does its own communication at the attention / SwiGLU region boundaries (all-gather tokens in, reduce-scatter out, in
bf16); inside the region each FP8Linear runs its usual forward on the local shard with TE in its non-parallel mode
(no TE communication). That is correct: every rank's GEMM is local with its own scales (column-parallel inputs are the
same gathered tokens on every rank; row-parallel partial sums are dequantised by each rank's GEMM before the
high-precision reduce-scatter).

Shapes: TE's FP8 GEMMs need the feature dims to be multiples of 16 (config.validate checks every dense projection,
per TP rank) and the token count a multiple of 16 (it is the leading dimension of the wgrad GEMM: with 8, as TE's
forward alone would allow, the backward failed an H100 test): rows are zero-padded up to a multiple of 16 here (zero
rows change no amax and add nothing to dW) and cut off again.

TE is optional: this module never imports it at import time. On a CPU-only machine (or for CPU tensors) `model.fp8`
leaves the dense linears on `F.linear`. On a machine with CUDA and `model.fp8` set but no importable TE, building the
layer fails with an error naming the cause and the fix: a silent or warned bf16 fallback would make an "fp8" run or
benchmark measure something other than what it says.
"""

from __future__ import annotations

import functools
import importlib.metadata

import torch
import torch.nn.functional as F
from torch import nn

from services.common import logs

log = logs.logger("trainer")

RECIPES = ("tensorwise", "blockwise")
ROW_MULTIPLE = 16  # TE: the token count is the wgrad GEMM's leading dim, which FP8 needs a multiple of 16 (seen on an H100)
FEATURE_MULTIPLE = 16  # TE: in_features and out_features multiples of 16 (16-byte e4m3 rows)


class _TEHandle:
    """Holds a layer's TE module outside the module tree (a plain attribute, not a submodule). A copy of the layer
    (`copy.deepcopy`, e.g. an RL reference model) starts without one: it is rebuilt, bound to the copy's weight."""

    __slots__ = ("module",)

    def __init__(self):
        self.module = None

    def __deepcopy__(self, memo) -> "_TEHandle":
        return _TEHandle()


@functools.cache
def _import_te() -> tuple[object | None, str]:
    """(transformer_engine.pytorch, "") or (None, why it did not import). Asked once per process."""
    try:
        import transformer_engine.pytorch as te
    except (ImportError, OSError, RuntimeError) as e:  # absent, or present without a loadable CUDA build
        return None, f"{type(e).__name__}: {e}"
    if not hasattr(te, "autocast"):  # written against TE 2.20; `te.autocast` replaced `fp8_autocast` in 2.x
        return None, f"transformer_engine {_te_version()} has no `autocast`: this code is written against 2.20"
    return te, ""


def _te_version() -> str:
    try:
        return importlib.metadata.version("transformer_engine")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _missing_te_error(fp8: str, why: str) -> RuntimeError:
    return RuntimeError(
        f"`model.fp8={fp8}` runs the dense linears (attention q/k/v/o and the SwiGLU MLPs) in FP8 through Transformer "
        f"Engine on CUDA, and this machine has CUDA but `transformer_engine` does not import ({why}). Install it "
        "(`pip install --no-build-isolation 'transformer-engine[pytorch]'`, matching the installed torch and CUDA) or "
        "set `model.fp8=''`.")


def require_te_on_cuda(fp8: str) -> None:
    """At model build: with `fp8` set on a machine with CUDA, Transformer Engine must import (see the module docstring
    for why this fails instead of falling back)."""
    if fp8 not in ("",) + RECIPES:
        raise ValueError(f"`model.fp8={fp8}` is not one of {['', *RECIPES]}")
    if fp8 and torch.cuda.is_available():
        te, why = _import_te()
        if te is None:
            raise _missing_te_error(fp8, why)


@functools.cache
def _te_recipe(fp8: str):
    """The TE recipe object for a `model.fp8` value, built once; checks this GPU supports it."""
    te, why = _import_te()
    if te is None:
        raise _missing_te_error(fp8, why)
    from transformer_engine.common import recipe as te_recipe

    if fp8 == "tensorwise":
        supported, reason = te.is_fp8_available(return_reason=True)
        built = te_recipe.Float8CurrentScaling()
    else:
        supported, reason = te.is_fp8_block_scaling_available(return_reason=True)
        built = te_recipe.Float8BlockScaling()
    if not supported:
        raise RuntimeError(f"`model.fp8={fp8}`: Transformer Engine cannot run this recipe on this GPU ({reason}); "
                           f"{'use model.fp8=tensorwise or ' if fp8 == 'blockwise' else ''}set model.fp8=''")
    log.info("dense linears in FP8 through Transformer Engine %s: %s", _te_version(), type(built).__name__)
    return built


class FP8Linear(nn.Linear):
    """nn.Linear whose matmul runs in FP8 through Transformer Engine on CUDA when `fp8` is set (module docstring)."""

    def __init__(self, in_features: int, out_features: int, fp8: str = "", bias: bool = False):
        require_te_on_cuda(fp8)
        super().__init__(in_features, out_features, bias=bias)
        self.fp8 = fp8
        self._te = _TEHandle()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8 or not x.is_cuda or x.numel() == 0:
            return F.linear(x, self.weight, self.bias)
        return self._te_forward(x)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", fp8={self.fp8}" if self.fp8 else "")

    def _te_module(self):
        """The TE Linear bound to this layer's current weight (built on first use; again if the shape changed)."""
        te, why = _import_te()
        if te is None:
            raise _missing_te_error(self.fp8, why)
        mod = self._te.module
        out_features, in_features = self.weight.shape
        if mod is None or (mod.out_features, mod.in_features) != (out_features, in_features):
            if out_features % FEATURE_MULTIPLE or in_features % FEATURE_MULTIPLE:
                raise ValueError(f"`model.fp8={self.fp8}`: a linear of {in_features} -> {out_features} features "
                                 "(per TP rank) cannot run in FP8: Transformer Engine needs multiples of "
                                 f"{FEATURE_MULTIPLE}; change the model sizes or set model.fp8=''")
            mod = te.Linear(in_features, out_features, bias=False, device="meta", params_dtype=self.weight.dtype)
            self._te.module = mod
        if mod.weight is not self.weight:
            mod.weight = self.weight  # a Parameter: TE's `weight` slot now holds ours (its meta one is dropped)
        return mod

    def _te_forward(self, x: torch.Tensor) -> torch.Tensor:
        te, _ = _import_te()
        recipe = _te_recipe(self.fp8)
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        pad = -n % ROW_MULTIPLE
        if pad:
            rows = F.pad(rows, (0, 0, 0, pad))
        mod = self._te_module()
        with te.autocast(enabled=True, recipe=recipe):
            out = mod(rows)
        if pad:
            out = out[:n]
        if self.bias is not None:  # added in the output's precision, outside the FP8 GEMM (its dgrad: a row sum)
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1])
