"""One optimizer step's forward and backward over its micro-batches (no pipeline; the pipeline schedule has the same shape).

Loss normalisation is by tokens: every micro-batch contributes Σ token losses / (loss tokens of the whole step), so the
gradient does not depend on how tokens were split into micro-batches, packed, or spread over data-parallel ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from services.trainer.model.attention import longest_document
from services.trainer.model.loss import IGNORE_INDEX
from services.trainer.model.moe.experts import fp8_weights_held


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` without waiting for the device: a copy from pageable host memory first synchronizes the stream
    (CUDA's rule), which would drain the queue the host has built ahead, so host tensors go through pinned memory
    (torch's caching host allocator, which keeps the pinned buffer until the copy has run) first."""
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The micro-batch's tensors on `device`, copied without waiting for the device (`host_to_device`). Its longest
    document (`max_seqlen`, which the attention kernels take as a host number) is read from the host's `cu_seqlens`
    first: the attention would otherwise read it from the device's copy, a host wait at every micro-batch, and a long
    one while a checkpoint's device-to-host copies hold the copy engine (bench/RESULTS.md, the save's 0.45 s)."""
    out = {k: host_to_device(v, device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    cu = batch.get("cu_seqlens")
    if "max_seqlen" not in batch and isinstance(cu, torch.Tensor) and cu.device.type == "cpu" and len(cu) > 1:
        out["max_seqlen"] = longest_document(cu)
    return out


def count_loss_tokens(micro_batches: list[dict[str, torch.Tensor]]) -> int:
    return int(sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches))


def forward_backward(model: nn.Module, micro_batches: list[dict[str, torch.Tensor]], step_tokens: int,
                     device: torch.device, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """Runs forward+backward on each micro-batch; returns this rank's summed token loss (detached, fp32)."""
    total = torch.zeros((), device=device)
    with fp8_weights_held(model, len(micro_batches)):
        for mb in micro_batches:
            mb = to_device(mb, device)
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss_sum = model(mb["tokens"], mb["position_ids"], mb["cu_seqlens"], mb.get("max_seqlen"),
                                 labels=mb["labels"], mtp_labels=mb.get("mtp_labels"))
            (loss_sum / step_tokens).backward()
            total += loss_sum.detach()
    return total
