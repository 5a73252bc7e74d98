"""Routed experts: SwiGLU FFNs held as stacked weights and run as one grouped GEMM.

`w13` fuses gate and up projections ([E, h, 2f]) so a single grouped GEMM feeds the activation; `w2` is [E, f, h].
On CUDA both GEMMs are `torch._grouped_mm` over the expert-sorted rows (offsets = cumulative tokens per expert, read from
device memory: no host sync), or without autograd and with few rows per expert (a rollout decode step: at most
`kernels.grouped_mm_small.FEW_ROWS` on average) `kernels.grouped_mm_small`, which streams each expert's weight once;
the CPU path runs the same math expert by expert (the CPU grouped-mm kernel has alignment limits and no backward we
can rely on).

With `fp8` ("tensorwise" or "blockwise", config `model.fp8`) the two grouped GEMMs on CUDA are
`kernels.fp8_grouped_mm.fp8_grouped_linear` instead: the rows and the (fp32 or bf16 master) weights are quantised to
e4m3 on the device each call, forward and dgrad run the FP8 Triton kernel, wgrad runs in bf16. The CPU path ignores
it (the torch path in the parameters' dtype), as it ignores the Triton kernels. Inside `fp8_weights_held` (the step's
forward and backward passes, where the weights cannot change) each weight is quantised once per step when the step
has several passes, and every later micro-batch reuses the e4m3 copies.

Rows past the last expert's (dropped copies, when the dispatcher keeps a fixed T·k-row buffer) are not computed: their
output rows are left unspecified and the combine step never reads them.

The router weight of each row is folded into the activation (memory-efficient permutation). With
`fused_activation` that is the Triton `swiglu_prob` kernel, which keeps only its inputs for backward; otherwise plain
torch ops. With `recompute_activation` (config `model.recompute: [moe_act]`) the activation's [rows, f] output is not
kept by the down projection either: it is rebuilt from the gate/up rows when backward needs it. With `recompute_fc1`
(`model.recompute: [moe_fc1]`) the gate/up rows [rows, 2f] are not kept by the activation: the first GEMM runs again.
(On the torch-ops activation, i.e. without the fused kernel, `moe_act` checkpoints the activation, and torch's
checkpoint holds its input: there `moe_act` with `moe_fc1` keeps the gate/up rows after all.)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from kernels.grouped_mm_small import FEW_ROWS, grouped_mm_small
from services.trainer.model import recompute


def swiglu_weighted(h13: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up · router weight: the weight is applied before the down projection (it is linear), which is where
    memory-efficient permutation folds it in."""
    gate, up = h13.chunk(2, dim=-1)
    return F.silu(gate) * up * weights.to(h13.dtype)[:, None]


def triton_applies(x: torch.Tensor) -> bool:
    """Triton kernels run on CUDA tensors, and on CPU tensors in Triton's interpreter when TRITON_INTERPRET=1 (the kernel
    tests). Decided without importing triton, which the CPU training path does not need."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET", "") == "1"


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, fused_activation: bool = False,
                 fp8: str = ""):
        super().__init__()
        self.fp8 = fp8  # "", "tensorwise" or "blockwise": the CUDA path's grouped GEMMs in FP8
        self.num_experts = num_experts
        self.w13 = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * ffn_hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.fused_activation = fused_activation
        self.recompute_activation = False  # set by recompute.apply_memory_policy
        self.recompute_fc1 = False  # likewise
        self.fp8_weights: dict[str, tuple] | None = None  # name -> quantize_weight(...) inside `fp8_weights_held`

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return self._grouped(x, tokens_per_expert, weights)
        return self._looped(x, tokens_per_expert, weights)

    def _activation(self, h13: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.fused_activation and triton_applies(h13):
            from kernels.swiglu import swiglu_prob

            return swiglu_prob(h13, weights)
        return swiglu_weighted(h13, weights)

    def _expert_path(self, x: torch.Tensor, up, weights: torch.Tensor, down) -> torch.Tensor:
        """down(activation(up(x), weights)), keeping for backward what the memory policy leaves: with `recompute_fc1`
        (config `model.recompute: [moe_fc1]`) the [rows, 2f] output of `up` is rebuilt by running `up` again."""
        h13 = up(x)
        if not self.recompute_fc1 or not torch.is_grad_enabled():
            return self._activation_then(h13, weights, down)
        rows = recompute.rebuilder(x)  # not x itself when the dispatch discarded it too
        recompute.discard_output(h13, lambda: up(rows()))
        with recompute.dropping_discarded():
            return self._activation_then(h13, weights, down)

    def _activation_then(self, h13: torch.Tensor, weights: torch.Tensor, down) -> torch.Tensor:
        """down(activation(h13, weights)); with `recompute_activation` the activation output is not kept for backward."""
        if not self.recompute_activation or not torch.is_grad_enabled():
            return down(self._activation(h13, weights))
        fused = self.fused_activation and triton_applies(h13)
        # The fused kernel already keeps only its inputs; the torch ops keep [rows, f] intermediates unless checkpointed.
        activation = self._activation if fused else recompute.checkpointed(self._activation)
        h13_later = recompute.rebuilder(h13)  # not h13 itself when `recompute_fc1` discarded it
        h = recompute.discard_output(activation(h13, weights), lambda: self._activation(h13_later(), weights))
        with recompute.dropping_discarded():
            return down(h)

    def _grouped(self, x, tokens_per_expert, weights):
        # Grouped GEMMs are outside autocast's op list: cast explicitly to the autocast dtype (bf16 in training).
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        offs = tokens_per_expert.cumsum(0).to(torch.int32)
        if self.fp8:  # the quantisers read the master weights as they are: no bf16 copy
            from kernels.fp8_grouped_mm import fp8_grouped_linear

            w13, w2 = self.w13, self.w2
            mm = lambda a, w: fp8_grouped_linear(a, w, offs, self.fp8, self._quantized(w))  # noqa: E731
        elif (not torch.is_grad_enabled() and x.shape[0] <= FEW_ROWS * offs.numel()  # a decode step's few rows
              and not torch.compiler.is_compiling()):  # (compiled blocks keep the op torch knows)
            w13, w2 = self.w13.to(dtype), self.w2.to(dtype)
            mm = lambda a, w: grouped_mm_small(a, w, offs)  # noqa: E731
        else:  # cast once: the GEMMs' backward and a `recompute_fc1` rerun share the copy
            w13, w2 = self.w13.to(dtype), self.w2.to(dtype)
            mm = lambda a, w: torch._grouped_mm(a, w, offs=offs)  # noqa: E731
        return self._expert_path(x.to(dtype), lambda a: mm(a, w13), weights, lambda h: mm(h, w2))

    def _quantized(self, w: nn.Parameter) -> tuple | None:
        """`quantize_weight(w, self.fp8)`, made at the first call inside `fp8_weights_held` and kept until its end;
        None outside it (the linear then quantises at each call)."""
        if self.fp8_weights is None:
            return None
        from kernels.fp8_quantize import quantize_weight

        name = "w13" if w is self.w13 else "w2"
        if name not in self.fp8_weights:  # (the linear marks the copy it saves as a weight copy, held or not)
            with torch.no_grad():
                self.fp8_weights[name] = quantize_weight(w, self.fp8)
        return self.fp8_weights[name]

    def held_weight_copies(self) -> list[torch.Tensor]:
        """The e4m3 weights (both layouts) and their scales held inside `fp8_weights_held`; for the memory report,
        which counts them as parameter copies (the one layout a linear saves for backward it would see anyway)."""
        return [t for copies in (self.fp8_weights or {}).values() for t in copies]

    def _looped(self, x, tokens_per_expert, weights):
        counts = tokens_per_expert.tolist()  # the CPU path may sync: there is no device to wait for
        tail = x.shape[0] - sum(counts)  # rows of dropped copies past the last expert's: not computed
        outs = []
        for e, (xe, we) in enumerate(zip(x.split(counts + [tail]), weights.split(counts + [tail]))):
            if e == len(counts):
                outs.append(x.new_zeros(tail, self.w2.shape[-1]))
                break
            outs.append(self._expert_path(xe, lambda a, e=e: a @ self.w13[e], we, lambda h, e=e: h @ self.w2[e]))
        return torch.cat(outs) if outs else x.new_zeros(0, self.w2.shape[-1])


@contextmanager
def fp8_weights_held(model: nn.Module, forwards: int) -> Iterator[None]:
    """Around one optimizer step's forward and backward passes (`forwards` of them: its micro-batches, and any no-grad
    pass over the same weights): with more than one, each FP8 expert layer quantises its weights once, at first use,
    and reuses the e4m3 copies for every later pass (and any `moe_fc1` recompute in backward). Transformer Engine
    caches its FP8 weights across micro-batches the same way (`is_first_microbatch`); without it every micro-batch
    quantises all expert weights again (bench/RESULTS.md: 6.8 ms of an H100 step at the Qwen3 shape).

    The weights must not change inside: the optimizer steps after it. The copies are dropped on exit. A held copy keeps
    both layouts (2 bytes per expert parameter) for the whole scope, where a pass of its own keeps one layout until its
    backward; so with one pass nothing is held, `moe_fc1` or not: that recompute saves the [rows, 2f] gate/up
    activations (201 MB per layer at the Qwen3 step's shape), which a held layout of the weights (604 MB per
    layer) would more than take back. Its rerun quantises w13 again instead (~1 ms per layer on an H100). Inside an
    enclosing scope the enclosing one's copies stay (and go at its exit)."""
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts) and m.fp8]
    held = [m for m in experts if m.fp8_weights is None] if forwards > 1 else []
    for m in held:
        m.fp8_weights = {}
    try:
        yield
    finally:
        for m in held:
            m.fp8_weights = None
