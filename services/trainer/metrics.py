"""Model FLOPs, MFU and the per-step record the trainer prints and exports."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from services.common.config import ModelConfig

# Dense bf16 tensor-core peaks from the datasheets (TFLOP/s, no sparsity).
DATASHEET_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0}


def attention_params(cfg: ModelConfig) -> int:
    """Weights of one attention layer's projections (norm scales do no multiply-adds)."""
    h, heads = cfg.hidden_size, cfg.num_heads
    if cfg.attention == "gqa":
        return h * cfg.kv_channels * (heads * 2 + cfg.num_kv_heads * 2)
    q_rank = cfg.q_lora_rank
    q = (h * q_rank + q_rank * heads * cfg.qk_head_dim) if q_rank else h * heads * cfg.qk_head_dim
    kv = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim +
                                                                                     cfg.v_head_dim)
    return q + kv + heads * cfg.v_head_dim * h


def layer_params(cfg: ModelConfig, layer_id: int) -> int:
    """Parameters a token multiplies with in decoder block `layer_id`: attention, and its MLP or top-k experts +
    shared expert + router."""
    h = cfg.hidden_size
    if layer_id < cfg.first_k_dense:
        mlp = 3 * h * cfg.ffn_hidden_size
    else:
        routed, shared = cfg.moe_ffn_hidden_size * cfg.top_k, cfg.shared_expert_ffn_hidden_size
        mlp = 3 * h * (routed + shared) + h * cfg.num_experts
    return attention_params(cfg) + mlp


def active_params(cfg: ModelConfig) -> int:
    """Parameters a token actually multiplies with: every block's (`layer_params`) and the output layer's."""
    return sum(layer_params(cfg, i) for i in range(cfg.num_layers)) + cfg.hidden_size * cfg.vocab_size


def layer_flops(cfg: ModelConfig, layer_id: int, seq_len: int) -> float:
    """Forward + backward FLOPs per token of block `layer_id`: 6 per weight, and the attention score (q·k) and value
    (p·v) GEMMs, 3·heads·(qk head dim + v head dim)·seq (2 FLOPs per multiply-add, x3 for backward, half the keys
    visible under the causal mask)."""
    core = 3.0 * cfg.num_heads * (cfg.qk_head_dim + cfg.value_head_dim) * seq_len
    return 6.0 * layer_params(cfg, layer_id) + core


def output_flops(cfg: ModelConfig) -> float:
    """Forward + backward FLOPs per token of the output layer (the loss's own work is negligible beside it)."""
    return 6.0 * cfg.hidden_size * cfg.vocab_size


def mtp_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token of the multi-token prediction depths (mtp.py): each one's eh_proj, block
    and the shared output layer."""
    depths = range(cfg.num_layers, cfg.num_layers + cfg.mtp_num_layers)
    return sum(6.0 * 2 * cfg.hidden_size ** 2 + layer_flops(cfg, i, seq_len) + output_flops(cfg) for i in depths)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Every block's `layer_flops`, the output layer's and the MTP depths': 6·N_active + 3·L·heads·(qk + v head
    dim)·seq (for GQA, 6·L·heads·head_dim·seq) without MTP."""
    blocks = sum(layer_flops(cfg, i, seq_len) for i in range(cfg.num_layers))
    return blocks + output_flops(cfg) + mtp_flops(cfg, seq_len)


class TrainingDiverged(RuntimeError):
    """A step's loss or gradient norm is NaN or infinite."""


def check_finite(step: int, loss: float, grad_norm: float) -> None:
    """Raise `TrainingDiverged` naming `step` (1-based) when its loss or gradient norm is not finite. The trainer checks
    every step as it reports it, and a step it is about to checkpoint before the save: a checkpoint never holds the
    weights of a diverged step, and retention never drops the last finite ones for them."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    raise TrainingDiverged(f"step {step}: loss {loss}, gradient norm {grad_norm}: training diverged, stopped before "
                           "any checkpoint holds it; resume from the newest checkpoint (`foldmoe status`) with a "
                           "lower optimizer.lr, a longer optimizer.warmup_steps or a lower optimizer.clip_grad")


class StepValues:
    """One step's device tensors (loss, gradient norm, expert loads), copied to host memory as soon as the step is
    queued. `read()` waits for that step's work only (an event recorded after the copies), not for work queued after
    it: the trainer queues step k+1 before it reads step k, so the device never idles while the host logs. Reading a
    device tensor directly (`float(loss)`) would wait for everything queued, and the next step would start on an
    empty queue, its first milliseconds bound by the host's launches.

    The copies run on a stream of their own (`_readback_stream`), ordered after the step: a device-to-host copy waits
    for every device-to-host copy queued before it on the copy engine, a checkpoint's too (0.45 s for a 25 GB state on
    an H100, bench/RESULTS.md), and on the training stream it would hold every kernel queued after it as long. Here
    only `read()` waits; `ready()` says whether it would."""

    def __init__(self, **tensors: torch.Tensor):
        device = next((t.device for t in tensors.values() if t.is_cuda), None)
        self._done, self._sources = None, None
        if device is None:
            self._host = {k: t.detach().to("cpu") for k, t in tensors.items()}
            return
        stream = _readback_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            # non_blocking copies from CUDA land in pinned host memory (torch allocates the result pinned)
            self._host = {k: t.detach().to("cpu", non_blocking=True) for k, t in tensors.items()}
            self._done = torch.cuda.Event()
            self._done.record(stream)
        self._sources = tensors  # alive until copied: the training stream may reuse their memory once they are freed

    def ready(self) -> bool:
        return self._done is None or self._done.query()

    def read(self) -> dict[str, torch.Tensor]:
        if self._done is not None:
            self._done.synchronize()
            self._sources = None
        return self._host


_READBACK: dict[torch.device, torch.cuda.Stream] = {}


def _readback_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _READBACK:
        _READBACK[device] = torch.cuda.Stream(device=device)
    return _READBACK[device]


class StepEnd:
    """Where a step's work ends in the device's queue, and when the device got there. A step's time is the time from
    the previous step's end to its own, on the device's clock: `ends[k].seconds_since(ends[k - 1])`.

    Not the host's clock at each report: the trainer reports step k after it has queued step k+1 (`StepValues`). When
    the device is the bottleneck, report k returns as the device finishes step k, so reports are a step apart; but when
    the host is (a CPU run, where queuing a step computes it, or launch-bound steps), report k returns once step k+1 is
    queued, and the time between reports k-1 and k is step k+1's: every record one step late, the first holding two
    steps' time and the last (no step queued after it) next to none. The device's clock has neither bias: on CUDA, a
    timed event queued where the step's work ends (the time to the previous step's event is the device's work plus any
    time it sat idle waiting for the host: data, launches, a checkpoint stall); on the CPU the work is done when the
    host records the end, so the host's clock then."""

    def __init__(self, device: torch.device):
        self.host = time.perf_counter()
        self.event = None
        if device.type == "cuda":
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record(torch.cuda.current_stream(device))

    def wait(self) -> None:
        """Until the device has reached this end (and so every earlier one on its stream)."""
        if self.event is not None:
            self.event.synchronize()

    def seconds_since(self, earlier: "StepEnd") -> float:
        """Seconds from `earlier` to this end, both reached (`wait`)."""
        if self.event is not None and earlier.event is not None:
            return earlier.event.elapsed_time(self.event) / 1000
        return self.host - earlier.host


def datasheet_peak(device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in DATASHEET_PEAK_TFLOPS.items() if k in name), 0.0)


def measure_peak_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """Best achieved dense GEMM rate on this device right now: the honest denominator for MFU next to the datasheet's."""
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - t0) / 4)
    return 2 * n**3 / best / 1e12


class MetricsLog:
    """Appends one JSON record per step (for plotting) and keeps the running totals."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a") if self.path else None

    def write(self, record: dict) -> None:
        if self._fh:
            self._fh.write(json.dumps(record) + "\n")
            self._fh.flush()

    def close(self) -> None:
        if self._fh:
            self._fh.close()
