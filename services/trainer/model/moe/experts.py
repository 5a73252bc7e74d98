"""Routed experts: SwiGLU FFNs held as stacked weights and run as one grouped GEMM.

`w13` fuses gate and up projections ([E, h, 2f]) so a single grouped GEMM feeds the activation; `w2` is [E, f, h].
On CUDA both GEMMs are `torch._grouped_mm` over the expert-sorted rows (offsets = cumulative tokens per expert, read from
device memory: no host sync); the CPU path runs the same math expert by expert (the CPU grouped-mm kernel has alignment
limits and no backward we can rely on).

With `fp8` ("tensorwise" or "blockwise", config `model.fp8`) the two grouped GEMMs on CUDA are
`kernels.fp8_grouped_mm.fp8_grouped_linear` instead: the rows and the (fp32 or bf16 master) weights are quantised to
e4m3 on the device each call, forward and dgrad run the FP8 Triton kernel, wgrad runs in bf16. The CPU path ignores
it (the torch path in the parameters' dtype), as it ignores the Triton kernels.

Rows past the last expert's (dropped copies, when the dispatcher keeps a fixed T·k-row buffer) are not computed: their
output rows are left unspecified and the combine step never reads them.

The router weight of each row is folded into the activation (memory-efficient permutation). With
`fused_activation` that is the Triton `swiglu_prob` kernel, which keeps only its inputs for backward; otherwise plain
torch ops. With `recompute_activation` (config `model.recompute: [moe_act]`) the activation's [rows, f] output is not
kept by the down projection either: it is rebuilt from the gate/up rows when backward needs it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

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

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return self._grouped(x, tokens_per_expert, weights)
        return self._looped(x, tokens_per_expert, weights)

    def _activation(self, h13: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.fused_activation and triton_applies(h13):
            from kernels.swiglu import swiglu_prob

            return swiglu_prob(h13, weights)
        return swiglu_weighted(h13, weights)

    def _activation_then(self, h13: torch.Tensor, weights: torch.Tensor, down) -> torch.Tensor:
        """down(activation(h13, weights)); with `recompute_activation` the activation output is not kept for backward."""
        if not self.recompute_activation or not torch.is_grad_enabled():
            return down(self._activation(h13, weights))
        fused = self.fused_activation and triton_applies(h13)
        # The fused kernel already keeps only its inputs; the torch ops keep [rows, f] intermediates unless checkpointed.
        activation = self._activation if fused else recompute.checkpointed(self._activation)
        h = recompute.discard_output(activation(h13, weights), lambda: self._activation(h13, weights))
        with recompute.dropping_discarded():
            return down(h)

    def _grouped(self, x, tokens_per_expert, weights):
        # Grouped GEMMs are outside autocast's op list: cast explicitly to the autocast dtype (bf16 in training).
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        offs = tokens_per_expert.cumsum(0).to(torch.int32)
        if self.fp8:  # the quantisers read the master weights as they are: no bf16 copy
            from kernels.fp8_grouped_mm import fp8_grouped_linear

            mm = lambda a, w: fp8_grouped_linear(a, w, offs, self.fp8)  # noqa: E731
        else:
            mm = lambda a, w: torch._grouped_mm(a, w.to(dtype), offs=offs)  # noqa: E731
        h13 = mm(x.to(dtype), self.w13)
        return self._activation_then(h13, weights, lambda h: mm(h, self.w2))

    def _looped(self, x, tokens_per_expert, weights):
        counts = tokens_per_expert.tolist()  # the CPU path may sync: there is no device to wait for
        tail = x.shape[0] - sum(counts)  # rows of dropped copies past the last expert's: not computed
        outs = []
        for e, (xe, we) in enumerate(zip(x.split(counts + [tail]), weights.split(counts + [tail]))):
            if e == len(counts):
                outs.append(x.new_zeros(tail, self.w2.shape[-1]))
                break
            outs.append(self._activation_then(xe @ self.w13[e], we, lambda h, e=e: h @ self.w2[e]))
        return torch.cat(outs) if outs else x.new_zeros(0, self.w2.shape[-1])
