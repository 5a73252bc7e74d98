"""Loaded by pytest before any test module: the kernel tests need Triton built for its CPU interpreter, which works only
if that happens before anything else imports triton (the model imports the `kernels` package). Also holds the
fixtures that several test files share."""

import kernels_interpreter  # noqa: F401
import pytest
import torch


@pytest.fixture
def as_on_a_cpu_machine(monkeypatch):
    """`torch.cuda.is_available()` answers False: for tests that build models with `model.fp8` set and run them on
    CPU, which on a machine with CUDA but no Transformer Engine would (rightly) refuse to build."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
