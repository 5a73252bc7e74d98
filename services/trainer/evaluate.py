"""The held-out loss: the evaluation set's micro-batches through the model, forward only.

The evaluation set (services/dataloader/heldout.py) is fixed, so evaluations at two steps read the same tokens. Every
layout runs the forward a training step runs: each micro-batch cut over its CP group, TP's vocab-parallel loss, the
experts' dispatch over EP, the pipeline's forward-only schedule (`loss_forward_pipeline`). The loss is the
token-weighted mean over every dp rank's share, so a folded layout reports what one process reports over the whole set
(tests/test_parallel_eval.py).

Nothing of the training state moves: the model runs in eval mode (routers add no aux loss or z-loss) and the routers'
load counts, which the aux-loss-free bias update reads at the step's end, are put back as they were. With MTP depths,
their mean loss over the set is reported too (and their sums cleared, so the next step's record holds its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from services.common.config import Config
from services.dataloader.errors import DataError
from services.trainer.model.mtp import mean_per_target
from services.trainer.parallel.context_parallel import cp_share, shard_micro_batch
from services.trainer.parallel.groups import ParallelGroups, sum_over
from services.trainer.parallel.pipeline import loss_forward_pipeline
from services.trainer.step import count_loss_tokens, host_to_device


@dataclass
class EvalResult:
    loss: float  # mean token cross-entropy over the whole evaluation set
    tokens: int  # loss tokens of the whole set
    mtp_loss: float | None = None  # the MTP depths' mean loss per target token (model.mtp_num_layers), else None


def evaluate(model: nn.Module, micro_batches: list[dict[str, torch.Tensor]], groups: ParallelGroups, cfg: Config,
             device: torch.device, autocast_dtype: torch.dtype | None) -> EvalResult:
    """The loss over the evaluation set, from this dp rank's share of it (`DataClient.eval_micro_batches`). Every rank
    of the run calls it at the same step (it all-reduces over DP x CP and PP) and gets the same result."""
    if len(micro_batches) * groups.dp.size != cfg.data.eval_micro_batches:
        raise DataError(f"the dataloader served {len(micro_batches)} held-out micro-batches to each of the "
                        f"{groups.dp.size} dp ranks, but this trainer's `data.eval_micro_batches` is "
                        f"{cfg.data.eval_micro_batches}: start both from the same config")
    p = cfg.parallel
    local = [shard_micro_batch(mb, groups, p.cp_comm, cfg.model.mtp_num_layers)
             for mb in cp_share(micro_batches, groups.cp.size, groups.cp.rank)]
    tokens = sum_over(host_to_device(torch.tensor([float(count_loss_tokens(local))], dtype=torch.float64), device),
                      groups.dp_cp)
    moe_layers = model.moe_layers()
    loads = [moe.router.tokens_per_expert.clone() for moe in moe_layers]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            loss = loss_forward_pipeline(model, local, device, autocast_dtype, groups.pp.group,
                                         groups.tp.size if p.sequence_parallel else 1)
    finally:
        model.train(was_training)
        for moe, load in zip(moe_layers, loads):
            moe.router.tokens_per_expert.copy_(load)
    loss = sum_over(loss.reshape(1).clone(), groups.dp_cp, groups.pp)[0]
    mtp = None
    if cfg.model.mtp_num_layers:  # the depths' sums of this evaluation, taken so the next step's record has its own
        mtp = float(mean_per_target(sum_over(model.mtp_loss_sums.take(device), groups.dp_cp, groups.pp)))
    count = int(tokens[0].round())
    return EvalResult(loss=float(loss) / max(count, 1), tokens=count, mtp_loss=mtp)
