"""AdamW over flat tensors in one pass: fp32 master weights, moments, and the model's low-precision copy.

    adamw_step(master, grad, exp_avg, exp_avg_sq, param=None, *, lr, beta1, beta2, eps, weight_decay, step,
               grad_divisor=None)

torch.optim.AdamW's update (decoupled weight decay), per element, in fp32 with one rounding on each store:
    g = grad / grad_divisor
    master *= 1 - lr * weight_decay
    m = lerp(m, g, 1 - beta1)            v = beta2 * v + (1 - beta2) * g * g
    master -= lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)
    param = master rounded to param's dtype
`master` is fp32, or int16 remainders of a bf16 `param` (below); `grad` fp32 or bf16, only read; `exp_avg` and
`exp_avg_sq` each fp32 or bf16; `param` (optional) bf16, fp16 or fp32. All tensors have master's shape and device and
are contiguous. `grad_divisor` is a 0-d fp32 tensor on the device (the global-norm clip factor as a divisor >= 1): the
kernel reads it through a pointer, so clipping costs neither a pass over the gradients nor a host sync. `step` counts
updates, 1 at the first.

Remainders (Megatron-Core's `store_param_remainders`): a bf16 parameter already holds the upper 16 bits of its fp32
master weight, so only the lower 16 need storing. `split_master` makes the pair — the bf16 value rounded to nearest,
ties away from zero, and the signed int16 difference — and `join_master` gives the fp32 master back bit for bit. Given
an int16 `master`, the kernel joins, updates and splits again. The only difference from an fp32 master plus a
round-to-nearest-even copy is at exact ties (low half 0x8000, even upper half), where the bf16 copy rounds up instead
of down: round-to-nearest-even would need a remainder of +0x8000 there, which 16 bits cannot hold.

Why: with bf16 parameters and fp32 master weights the library path is three passes — grad.float() (read 2 B,
write 4 B), torch._fused_adamw_ on the master (with a grad scale it also writes the scaled gradient back: 32 B),
then param.copy_(master) (read 4 B, write 2 B): 44 B per element. This kernel moves, per element
    read master (4|2) + grad (4|2) + exp_avg (4|2) + exp_avg_sq (4|2) (+ param 2 with remainders);
    write master (4|2) + moments + param (0|2|4)
    fp32 moments, bf16 grad, bf16 param:           reads 4+2+4+4,   writes 4+4+4+2 = 28 B
    bf16 moments, bf16 grad, bf16 param:           reads 4+2+2+2,   writes 4+2+2+2 = 20 B
    same with remainders (6 B of state, not 8):    reads 2+2+2+2+2, writes 2+2+2+2 = 18 B
    all fp32, no param (the fp32-parameter step):  reads 4+4+4+4,   writes 4+4+4   = 28 B
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._triton import use_triton

_GRAD_DTYPES = (torch.float32, torch.bfloat16)
_MOMENT_DTYPES = (torch.float32, torch.bfloat16)
_PARAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# One fixed launch shape, not autotuned: the kernel updates in place, so tuning would have to clone master, moments
# and param on its first call (14 B per element: gigabytes for a large model's biggest tensor).
BLOCK, NUM_WARPS = 2048, 8


def _check(master, grad, exp_avg, exp_avg_sq, param, grad_divisor, step) -> None:
    tensors = {"master": master, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if param is not None:
        tensors["param"] = param
    allowed = {"master": (torch.float32, torch.int16), "grad": _GRAD_DTYPES, "exp_avg": _MOMENT_DTYPES,
               "exp_avg_sq": _MOMENT_DTYPES, "param": _PARAM_DTYPES}
    if isinstance(master, torch.Tensor) and master.dtype == torch.int16 \
            and not (isinstance(param, torch.Tensor) and param.dtype == torch.bfloat16):
        raise ValueError("adamw_step: an int16 `master` holds the remainders of a bf16 `param`; pass that param, got "
                         f"{getattr(param, 'dtype', None)}")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"adamw_step: `{name}` must be a tensor, got {type(t).__name__}")
        if t.dtype not in allowed[name]:
            raise ValueError(f"adamw_step: `{name}` must be one of {[str(d) for d in allowed[name]]}, got {t.dtype}")
        if t.shape != master.shape:
            raise ValueError(f"adamw_step: `{name}` has shape {tuple(t.shape)}, `master` {tuple(master.shape)}; "
                             f"all tensors must have master's shape")
        if t.device != master.device:
            raise ValueError(f"adamw_step: `{name}` is on {t.device}, `master` on {master.device}")
        if not t.is_contiguous():
            raise ValueError(f"adamw_step: `{name}` is not contiguous; pass flat buffers or call .contiguous() "
                             f"(in-place updates of a copy would be lost)")
    if grad_divisor is not None:
        if not isinstance(grad_divisor, torch.Tensor) or grad_divisor.dim() != 0 \
                or grad_divisor.dtype != torch.float32:
            raise ValueError("adamw_step: `grad_divisor` must be a 0-d fp32 tensor (or None), got "
                             f"{getattr(grad_divisor, 'shape', type(grad_divisor).__name__)} "
                             f"{getattr(grad_divisor, 'dtype', '')}")
        if grad_divisor.device != master.device:
            raise ValueError(f"adamw_step: `grad_divisor` is on {grad_divisor.device}, `master` on {master.device}; "
                             "keep it on the device (reading it on the host would sync)")
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"adamw_step: `step` is the update count after incrementing (1 at the first), got {step!r}")


def _scalars(lr: float, beta1: float, beta2: float, weight_decay: float, step: int) -> tuple[float, float, float]:
    """(decay factor, step size, sqrt of the second bias correction), on the host in double, as torch computes them."""
    return 1 - lr * weight_decay, lr / (1 - beta1 ** step), math.sqrt(1 - beta2 ** step)


# Elements per pass of split_master / join_master: bounds their int32 temporaries (a model's largest tensor can hold
# hundreds of millions of elements; a restore or the optimizer's construction must not double its memory).
_CHUNK = 1 << 24


@torch.no_grad()
def split_master(master: torch.Tensor, param: torch.Tensor | None = None,
                 remainder: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `master` -> (bf16 param, int16 remainder) with `join_master(param, remainder)` equal to it bit for bit:
    the param is master rounded to nearest, ties away from zero; the remainder the signed difference of their bits.
    Writes into `param` / `remainder` when given (master's shape), else into new tensors."""
    if master.dtype != torch.float32:
        raise ValueError(f"split_master: `master` must be fp32, got {master.dtype}")
    param = torch.empty_like(master, dtype=torch.bfloat16) if param is None else param
    remainder = torch.empty_like(master, dtype=torch.int16) if remainder is None else remainder
    bits, high, low = master.reshape(-1).view(torch.int32), param.view(-1).view(torch.int16), remainder.view(-1)
    for lo in range(0, bits.numel(), _CHUNK):
        b = bits[lo:lo + _CHUNK]
        h = (b + 0x8000) >> 16  # arithmetic shift: the sign bit rides along in the upper half
        high[lo:lo + _CHUNK] = h.to(torch.int16)
        low[lo:lo + _CHUNK] = (b - (h << 16)).to(torch.int16)
    return param, remainder


@torch.no_grad()
def join_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master weight a bf16 `param` and its int16 `remainder` stand for (the inverse of `split_master`)."""
    if param.dtype != torch.bfloat16 or remainder.dtype != torch.int16 or param.shape != remainder.shape:
        raise ValueError(f"join_master takes a bf16 param and an int16 remainder of one shape, got {param.dtype} "
                         f"{tuple(param.shape)} and {remainder.dtype} {tuple(remainder.shape)}")
    master = torch.empty(param.shape, dtype=torch.float32, device=param.device)
    bits, high, low = master.view(-1).view(torch.int32), param.reshape(-1).view(torch.int16), remainder.reshape(-1)
    for lo in range(0, bits.numel(), _CHUNK):
        bits[lo:lo + _CHUNK] = (high[lo:lo + _CHUNK].to(torch.int32) << 16) + low[lo:lo + _CHUNK].to(torch.int32)
    return master


@torch.no_grad()
def adamw_step_reference(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         param: torch.Tensor | None = None, *, lr: float, beta1: float, beta2: float, eps: float,
                         weight_decay: float, step: int, grad_divisor: torch.Tensor | None = None) -> None:
    """Same contract as `adamw_step`, in torch ops (torch.optim.AdamW's single-tensor formulation)."""
    _check(master, grad, exp_avg, exp_avg_sq, param, grad_divisor, step)
    if master.dtype == torch.int16:  # remainders: update the joined fp32 master, then split it back
        full = join_master(param, master)
        adamw_step_reference(full, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                             weight_decay=weight_decay, step=step, grad_divisor=grad_divisor)
        split_master(full, param, master)
        return
    decay, step_size, bc2_sqrt = _scalars(lr, beta1, beta2, weight_decay, step)
    g = grad.float() if grad_divisor is None else grad.float() / grad_divisor
    m, v = exp_avg.float(), exp_avg_sq.float()  # fp32 moments: the tensors themselves, updated in place
    master.mul_(decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    master.addcdiv_(m, (v.sqrt() / bc2_sqrt).add_(eps), value=-step_size)
    if m is not exp_avg:
        exp_avg.copy_(m)
    if v is not exp_avg_sq:
        exp_avg_sq.copy_(v)
    if param is not None:
        param.copy_(master)


@triton.jit
def _adamw_kernel(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, param_ptr, divisor_ptr, n,
                  decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps,
                  HAS_PARAM: tl.constexpr, HAS_DIVISOR: tl.constexpr, REMAINDER: tl.constexpr, BLOCK: tl.constexpr):
    # int64 offsets: a flat buffer can hold more than 2**31 elements
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DIVISOR:
        g = tl.math.div_rn(g, tl.load(divisor_ptr))
    if REMAINDER:  # master = bf16 param's bits << 16 + the signed int16 remainder
        high = tl.load(param_ptr + offs, mask=mask, other=0.0).to(tl.int16, bitcast=True).to(tl.int32)
        low = tl.load(master_ptr + offs, mask=mask, other=0).to(tl.int32)
        p = ((high << 16) + low).to(tl.float32, bitcast=True)
    else:
        p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    p = p * decay
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = m + one_minus_beta1 * (g - m)  # torch's lerp(m, g, w) for w < 0.5
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.math.div_rn(tl.math.sqrt_rn(v), bc2_sqrt) + eps
    p = p - step_size * tl.math.div_rn(m, denom)
    tl.store(exp_avg_ptr + offs, m.to(exp_avg_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)
    if REMAINDER:  # split_master: round to nearest, ties away from zero; the signed difference stays behind
        bits = p.to(tl.int32, bitcast=True)
        high = (bits + 0x8000) >> 16
        tl.store(master_ptr + offs, (bits - (high << 16)).to(tl.int16), mask=mask)
        tl.store(param_ptr + offs, high.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(master_ptr + offs, p, mask=mask)
        if HAS_PARAM:
            tl.store(param_ptr + offs, p.to(param_ptr.dtype.element_ty), mask=mask)


def adamw_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               param: torch.Tensor | None = None, *, lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float, step: int, grad_divisor: torch.Tensor | None = None) -> None:
    """One AdamW update in place (see the module docstring). Triton on CUDA, the torch reference on CPU."""
    _check(master, grad, exp_avg, exp_avg_sq, param, grad_divisor, step)
    if not use_triton(master):
        adamw_step_reference(master, grad, exp_avg, exp_avg_sq, param, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                             weight_decay=weight_decay, step=step, grad_divisor=grad_divisor)
        return
    n = master.numel()
    if n == 0:
        return
    decay, step_size, bc2_sqrt = _scalars(lr, beta1, beta2, weight_decay, step)
    grid = (triton.cdiv(n, BLOCK),)
    # absent param / divisor: master stands in for the pointer, never read or written
    _adamw_kernel[grid](master, grad, exp_avg, exp_avg_sq, master if param is None else param,
                        master if grad_divisor is None else grad_divisor, n,
                        decay, 1 - beta1, beta2, 1 - beta2, step_size, bc2_sqrt, eps,
                        HAS_PARAM=param is not None, HAS_DIVISOR=grad_divisor is not None,
                        REMAINDER=master.dtype == torch.int16, BLOCK=BLOCK,
                        num_warps=NUM_WARPS)
