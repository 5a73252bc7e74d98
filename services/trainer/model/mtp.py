"""Multi-token prediction (DeepSeek-V3 §2.2; `model.mtp_num_layers` = D > 0): D more decoder blocks in sequence after
the main model, depth k predicting the token k + 1 positions after the next.

Depth k (1-based) at position i combines the previous depth's output h_i^{k-1} with the embedding of token t_{i+k}:
h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h_i^{k-1})]), runs a decoder block (attention and MoE, causal inside each
packed document as the main blocks) over h', and its own final norm gives h_i^k, from which the model's output layer
predicts t_{i+k+1}. h^0 is the main model's output after its final norm: what its output layer reads (as transformers'
`MtpModel` and vLLM take it). Embedding and output layer are the main model's (shared, as in DeepSeek-V3). The loss the
model returns stays the main one; the depths' cross-entropies join its backward scaled by `mtp_loss_coeff / D`
(λ / D), so the reported loss is comparable with and without MTP.

In a packed micro-batch t_{i+k} is labels[i + k - 1] (labels[i] = t_{i+1}), taken only inside i's own document:
positions whose target falls past their document's end predict nothing (`shift_in_document`). These shifted labels
(`future_labels`, one row per depth) come from the whole micro-batch: under context parallelism a rank's tokens are two
zigzag chunks whose following tokens another rank holds, so the sharding takes the rows before it cuts
(`context_parallel.shard_micro_batch`) and the model is handed them.

The step record's `mtp_loss` is the depths' mean cross-entropy per target token over the whole step: every micro-batch's
per-depth sums and counts (`MTPLossSums`) are summed over micro-batches and ranks before dividing.
"""

from __future__ import annotations

import torch
from torch import nn

from services.common.config import ModelConfig
from services.trainer.model.loss import IGNORE_INDEX


def shift_in_document(labels: torch.Tensor, segment_ids: torch.Tensor, k: int) -> torch.Tensor:
    """labels[i + k] where position i + k is in i's document, else IGNORE_INDEX; [T] -> [T]."""
    if k == 0:
        return labels
    out = torch.full_like(labels, IGNORE_INDEX)
    same = segment_ids[k:] == segment_ids[:-k]
    out[:-k] = torch.where(same, labels[k:], IGNORE_INDEX)
    return out


def future_labels(labels: torch.Tensor, segment_ids: torch.Tensor, depths: int) -> torch.Tensor:
    """[T] -> [depths, T]: row k holds labels shifted by k + 1 inside each document (depth k's targets; depth k + 1's
    input tokens)."""
    return torch.stack([shift_in_document(labels, segment_ids, k + 1) for k in range(depths)])


class MTPLossSums:
    """The depths' cross-entropy sums and target counts, [depths, 2] fp32 on the device, accumulated over a step's
    micro-batches (`add`, queued) until `take` hands them over and starts the next step from zero."""

    def __init__(self, depths: int):
        self.depths, self.sums = depths, None

    def add(self, depth: int, loss_sum: torch.Tensor, targets: int | torch.Tensor) -> None:
        if self.sums is None:
            self.sums = torch.zeros(self.depths, 2, dtype=torch.float32, device=loss_sum.device)
        self.sums[depth] += torch.stack([loss_sum.detach().float(), torch.as_tensor(targets).to(self.sums)])

    def take(self, device: torch.device) -> torch.Tensor:
        """This rank's sums since the last `take` (zeros where it ran no depth, e.g. a pipeline stage before the
        last)."""
        sums = self.sums if self.sums is not None else torch.zeros(self.depths, 2, dtype=torch.float32, device=device)
        self.sums = None
        return sums


def mean_per_target(sums: torch.Tensor) -> torch.Tensor:
    """[depths, 2] sums and counts (already summed over the step's ranks) -> the depths' mean of per-target losses."""
    return (sums[:, 0] / sums[:, 1].clamp(min=1)).mean()


class MTPLayer(nn.Module):
    """One depth: names as DeepSeek-V3's `model.layers.{L + k - 1}` (enorm, hnorm, eh_proj, the block, and
    `norm` for its shared_head.norm)."""

    def __init__(self, cfg: ModelConfig, block: nn.Module):
        super().__init__()
        h = cfg.hidden_size
        self.enorm = nn.RMSNorm(h, eps=cfg.norm_eps)
        self.hnorm = nn.RMSNorm(h, eps=cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = block  # a decoder block (transformer.Block), its layer id past the main model's
        self.norm = nn.RMSNorm(h, eps=cfg.norm_eps)

    def forward(self, embedded: torch.Tensor, previous: torch.Tensor, position_ids: torch.Tensor,
                cu_seqlens: torch.Tensor, segment_ids: torch.Tensor,
                max_seqlen: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings of t_{i+k} and the previous depth's output [T, h] -> the block's residual stream and last branch;
        `norm` of their sum is this depth's output (the output layer's input and the next depth's `previous`), taken
        by the caller with the add, as every block's (`transformer.residual_norm`: fused under model.compile).

        The depth's residual stream starts in the dtype the main one does, the embedding's (fp32 under bf16 autocast,
        also with bf16 parameters: optim.stays_fp32), not in eh_proj's autocast output dtype."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(previous)], dim=-1)).to(embedded.dtype)
        return self.block(x, position_ids, cu_seqlens, segment_ids, max_seqlen)
