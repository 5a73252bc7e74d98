"""Loaded by pytest before any test module: the kernel tests need Triton built for its CPU interpreter, which works only
if that happens before anything else imports triton (the model imports the `kernels` package). Also holds the
fixtures that several test files share.

gRPC's fork handlers are off in the test process, as in every process the launcher starts (services/launcher.py sets
GRPC_ENABLE_FORK_SUPPORT=false before gRPC is imported; tests/test_launcher_grpc_fork.py): the tests fork subprocesses
(launchers, torchrun, servers) while gRPC channels of earlier tests live, and those handlers aborted the whole test
process once (SIGABRT inside a channel's blocking call, test_dataloader_service.py, a full run of 2026-11-29)."""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # before anything imports grpc

import kernels_interpreter  # noqa: E402, F401
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from services.trainer.parallel.groups import Axis  # noqa: E402


@pytest.fixture
def as_on_a_cpu_machine(monkeypatch):
    """`torch.cuda.is_available()` answers False: for tests that build models with `model.fp8` set and run them on
    CPU, which on a machine with CUDA but no Transformer Engine would (rightly) refuse to build."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-process gloo world as an expert-parallel axis: the all-to-all dispatcher's collectives run (to this rank
    itself), so its code path, and what it sends, can be checked in one process."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        yield Axis("ep_etp", dist.group.WORLD, (0,), 0)
    finally:
        dist.destroy_process_group()
