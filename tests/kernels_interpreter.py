"""Where the kernel tests run the Triton kernels: on CUDA when there is a GPU, else in Triton's CPU interpreter.

Import this before anything that imports triton (the `kernels` package does). Triton builds its own library
functions, and `@triton.jit` builds ours, for the interpreter only if `TRITON_INTERPRET=1` is set at import, so on a
CPU machine this sets it for that import and then restores it: the kernel tests switch the interpreter on for
themselves through the `kernels_on_device` fixture, and every other test in the process keeps the fast CPU
reference path. On a machine with CUDA the kernels are compiled and the tests run them on the GPU.
"""

import contextlib
import importlib
import os
import sys

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")


@contextlib.contextmanager
def _interpreter_requested():
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def import_kernels(*names: str) -> list:
    """Import the modules that define the `@triton.jit` kernels a test runs: on a CPU machine with the interpreter
    requested for the import only, so their kernels are built for it (the kernels package's below; a bench probe's in
    its own test)."""
    if ON_CUDA:
        return [importlib.import_module(n) for n in names]
    with _interpreter_requested():
        return [importlib.import_module(n) for n in names]


if not ON_CUDA:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        from triton.runtime.jit import JITFunction
        import triton.language as _tl

        if isinstance(_tl.sum, JITFunction):
            raise RuntimeError("triton was imported before the kernel tests could switch on its CPU interpreter; "
                               "run pytest with TRITON_INTERPRET=1 in the environment")
# builds triton's library (on CPU, for the interpreter) and our kernels
import_kernels("kernels.cross_entropy", "kernels.permute", "kernels.router", "kernels.swiglu", "kernels.unpermute",
               "kernels.fp8_quantize", "kernels.fp8_grouped_mm", "kernels.adamw", "kernels.head_norm_rope",
               "kernels.sample", "kernels.truncation", "kernels.decode_attention", "kernels.decode_latent_attention",
               "kernels.grouped_mm_small")


@pytest.fixture(autouse=True)
def kernels_on_device(monkeypatch):
    """CPU tensors go through the Triton interpreter for the duration of a kernel test."""
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@contextlib.contextmanager
def interpreted_gloo_rank(rank: int, world: int, out_dir: str, timeout_s: float = 120.0):
    """A spawned test rank of a gloo group (file rendezvous in `out_dir`) whose CPU tensors take the Triton kernels
    through the interpreter, as `kernels_on_device` does for a test in this process; on a CUDA machine the ranks'
    CPU tensors take the torch path (this process's triton is built for the GPU)."""
    import datetime

    import torch.distributed as dist

    if not ON_CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        dist.destroy_process_group()
