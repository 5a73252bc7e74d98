"""Where the kernel tests run the Triton kernels: on CUDA when there is a GPU, else in Triton's CPU interpreter.

Import this before anything that imports triton (the `kernels` package does). Triton builds its own library
functions, and `@triton.jit` builds ours, for the interpreter only if `TRITON_INTERPRET=1` is set at import, so on a
CPU machine this sets it for that import and then restores it: the kernel tests switch the interpreter on for
themselves through the `kernels_on_device` fixture, and every other test in the process keeps the fast CPU
reference path. On a machine with CUDA the kernels are compiled and the tests run them on the GPU.
"""

import os
import sys

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")

if not ON_CUDA:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        from triton.runtime.jit import JITFunction
        import triton.language as _tl

        if isinstance(_tl.sum, JITFunction):
            raise RuntimeError("triton was imported before the kernel tests could switch on its CPU interpreter; "
                               "run pytest with TRITON_INTERPRET=1 in the environment")
    _previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    # builds triton's library and our kernels for the interpreter
    import kernels.cross_entropy, kernels.permute, kernels.router  # noqa: E401,E402,F401
    import kernels.swiglu, kernels.unpermute, kernels.fp8_grouped_mm, kernels.adamw  # noqa: E401,E402,F401
    import kernels.head_norm_rope  # noqa: E402,F401

    if _previous is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _previous


@pytest.fixture(autouse=True)
def kernels_on_device(monkeypatch):
    """CPU tensors go through the Triton interpreter for the duration of a kernel test."""
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
