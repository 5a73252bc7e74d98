"""The single-GPU training step queues without waiting for the device, and the trainer reads a step's values without
waiting for the steps queued after it: the host stays ahead, so the device never idles between steps (a drained queue
costs the next step's first milliseconds, launched one small kernel at a time; bench/RESULTS.md)."""

from __future__ import annotations

import time

import pytest
import torch

from services.common.config import ModelConfig, OptimizerConfig
from services.trainer.metrics import StepEnd, StepValues
from services.trainer.model.transformer import MoETransformer
from services.trainer.optim import build_adamw, clip_and_step
from services.trainer.parallel.groups import single_process
from services.trainer.parallel.parallelize import forward_backward_parallel
from services.trainer.step import forward_backward

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="host/device syncs exist on a CUDA device only")


def micro_batch(tokens: int = 512) -> dict:
    """As the dataloader client delivers one: CPU tensors, no `max_seqlen` (the step reads it from the host's
    `cu_seqlens`; the attention reading it from the device was a host sync per micro-batch)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 264, (tokens,), generator=gen)
    lengths = [200, 250, tokens - 450]
    return {"tokens": ids, "labels": torch.roll(ids, -1), "cp_size": torch.tensor(1),
            "cu_seqlens": torch.tensor([0] + lengths).cumsum(0).to(torch.int32),
            "position_ids": torch.cat([torch.arange(n) for n in lengths])}


def test_step_values_are_the_tensors_values():
    loss, loads = torch.tensor(3.5), torch.tensor([[1.0, 2.0]])
    got = StepValues(loss=loss, loads=loads).read()
    assert float(got["loss"]) == 3.5 and torch.equal(got["loads"], loads)


@cuda_only
@pytest.mark.parametrize("param_dtype", ["fp32", "bf16"])
def test_a_training_step_queues_without_a_host_sync(param_dtype):
    """Host micro-batch -> device copies, document ids, forward (attention, MoE with the Triton kernels, chunked
    cross-entropy), backward, gradient clipping and AdamW (torch's, or master weights with bf16 parameters): under
    torch's sync debug mode "error" any device-to-host wait inside raises."""
    cfg = ModelConfig(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=8, top_k=2,
                      moe_ffn_hidden_size=128, qk_norm=True)
    with torch.device("cuda"):
        model = MoETransformer(cfg)
    model.init_weights(0)  # the constructor leaves the experts' and router's weights uninitialised (torch.empty)
    opt = build_adamw(model, OptimizerConfig(param_dtype=param_dtype))  # bf16: re-stores the matrices in bf16
    mbs = [micro_batch()]
    device = torch.device("cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        loss = forward_backward(model, mbs, 512, device, torch.bfloat16)
        clip_and_step(opt, model.parameters(), 1.0)
        return loss

    step()  # first call: lazy initialisation (cuBLAS handles, Triton compiles) may wait for the device
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()


@cuda_only
def test_step_values_wait_for_their_step_only():
    x = torch.randn(4096, 4096, device="cuda")
    loss = x.sum()
    values = StepValues(loss=loss)
    for _ in range(40):  # the next "step": ~40 fp32 4096^3 GEMMs queued behind the copy
        x = (x @ x).clamp_(-1, 1)
    later = torch.cuda.Event()
    later.record()
    got = values.read()
    assert not later.query(), "read() waited for work queued after the step"
    assert float(got["loss"]) == pytest.approx(float(loss.cpu()))


@cuda_only
def test_a_folded_step_queues_without_a_host_sync():
    """`forward_backward_parallel` (the multi-rank step, here on the one-rank layout): its loss-token count and
    micro-batch share go to the device, are all-reduced there and divide the loss and the aux losses as device tensors;
    the count comes back as a tensor for the trainer to read with the step's other values."""
    from tests.parallel_harness import tiny_config

    cfg = tiny_config()
    cfg.model.hidden_size, cfg.model.num_heads, cfg.model.num_kv_heads = 256, 4, 2
    cfg.model.vocab_size, cfg.model.num_experts, cfg.model.moe_ffn_hidden_size = 264, 8, 128
    with torch.device("cuda"):
        model = MoETransformer(cfg.model)
    model.init_weights(0)  # the constructor leaves the experts' and router's weights uninitialised (torch.empty)
    mbs, device, groups = [micro_batch(), micro_batch()], torch.device("cuda"), single_process()

    def step():
        model.zero_grad(set_to_none=True)
        return forward_backward_parallel(model, mbs, groups, cfg, device, torch.bfloat16)

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, tokens = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.is_cuda and int(tokens) == 2 * 512
    assert torch.isfinite(loss).item()


def test_a_step_end_on_the_cpu_is_the_hosts_clock_when_the_work_is_done():
    first = StepEnd(torch.device("cpu"))
    time.sleep(0.05)
    second = StepEnd(torch.device("cpu"))
    second.wait()
    assert second.seconds_since(first) == pytest.approx(second.host - first.host) and second.host - first.host >= 0.05


@cuda_only
def test_a_step_end_times_the_device_work_not_the_hosts_queueing():
    """Two ends a queue of GEMMs apart: the host queues them in a moment; the time between the ends is the device's."""
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    first = StepEnd(torch.device("cuda"))
    for _ in range(40):
        x = (x @ x).clamp_(-1, 1)
    second = StepEnd(torch.device("cuda"))
    queued = time.perf_counter() - t0
    second.wait()
    wall = time.perf_counter() - t0
    device = second.seconds_since(first)
    assert device > 5 * queued, (device, queued)
    assert device == pytest.approx(wall, rel=0.2), (device, wall)
