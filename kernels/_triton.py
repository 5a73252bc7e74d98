"""When to run Triton: compiled on CUDA tensors, in Triton's CPU interpreter on CPU tensors when asked, else not.

Triton decides between compiling and interpreting once, when `triton` (and each `@triton.jit` function, its own
library included) is first imported, from `TRITON_INTERPRET`. So the interpreter is only usable in a process that
had `TRITON_INTERPRET=1` set before its first `import triton`; whether CPU calls go through it is then decided per
call, from the same variable, so a test can switch it on for itself and leave the fast torch reference to the rest.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

# Triton's own library functions (tl.sum, tl.cumsum, ...) are interpreted iff triton was imported in interpreter mode.
TRITON_INTERPRETED = not isinstance(tl.sum, JITFunction)


def interpreter_requested() -> bool:
    """True when `TRITON_INTERPRET=1` is set now."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def use_triton(x: torch.Tensor) -> bool:
    """Triton on CUDA tensors; on CPU tensors only when the interpreter is requested (tests), else the reference."""
    if x.is_cuda:
        return True
    if not interpreter_requested():
        return False
    if not TRITON_INTERPRETED:
        raise RuntimeError("TRITON_INTERPRET=1 asks for Triton's CPU interpreter, but triton was imported before "
                           "it was set, so its kernels are built for the GPU; set TRITON_INTERPRET=1 in the "
                           "environment before the first `import triton`")
    return True


def autotune_configs(configs: Sequence[triton.Config]) -> list[triton.Config]:
    """The configs to autotune over; only the first under the interpreter, which runs every program in Python, so
    benchmarking there would cost minutes and measure nothing. The first config must be valid for every shape."""
    return list(configs[:1]) if TRITON_INTERPRETED else list(configs)


def autotune(configs: Sequence[triton.Config], key: list[str], **kwargs):
    """`triton.autotune` over `autotune_configs(configs)`, its choice kept in Triton's cache on disk (keyed by the
    kernel's source, the GPU, Triton's version and the tuning key), so that a new process (`foldmoe generate`,
    `foldmoe evaluate`, a restarted trainer) reads it instead of timing every config again: seconds a process
    (bench/RESULTS.md). Configs with a pre-hook are timed every time (Triton cannot store them)."""
    return triton.autotune(configs=autotune_configs(configs), key=key, cache_results=True, **kwargs)


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))
