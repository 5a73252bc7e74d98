"""Casting an activation to the autocast dtype once, by hand, where several GEMMs read it.

Under autocast every GEMM casts its fp32 input to bf16 itself: an fp32 activation read by three projections is cast
three times forward, and backward adds three fp32 copies of their input gradients. Cast once, the GEMMs see the same
bf16 values; backward sums the projections' bf16 input gradients in bf16 (one rounding, as one fused QKV GEMM's
input gradient has) and casts the sum to fp32 once.
"""

from __future__ import annotations

import torch


def to_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """`x` in the autocast dtype when autocast is on for its device (a floating tensor), else `x` itself."""
    if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x
