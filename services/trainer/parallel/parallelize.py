"""The one entry that turns the single-device model into this rank's piece of the folded layout, and the step that runs it.

    model = MoETransformer(cfg.model); model.init_weights(seed)      # full weights, identical on every rank
    groups = init_groups(cfg)
    parallelize(model, cfg, groups)                                   # PP stage -> EP/ETP experts -> TP/SP -> CP cores
    optimizer = build_optimizer(model, cfg, groups)
    loss, tokens = forward_backward_parallel(model, micro_batches, groups, cfg, device, autocast, optimizer)
    grad_norm = optimizer.step(lr)

Order matters: the pipeline split comes first so only owned layers are sharded; experts are sliced from the full weights;
TP then shards what is left of the dense layers. Every rank starts from the same full initialisation, so any layout
begins exactly where the single-device model does. The trainer (train.py `build_model`) gets the same slices without
the full weights: it parallelizes a model whose parameters are still on the meta device, then reads each slice of the
seeded initial weights (model/initial_weights.py); the tests build it either way and compare.
"""

from __future__ import annotations

import torch
from torch import nn

from services.common.config import Config
from services.trainer.parallel.context_parallel import apply_context_parallel, cp_share, shard_micro_batch
from services.trainer.parallel.distributed_optimizer import DistributedOptimizer
from services.trainer.parallel.expert_parallel import apply_expert_parallel, bind_router_replicas
from services.trainer.parallel.groups import ParallelGroups, sum_over
from services.trainer.parallel.micro_batch_pairs import backward_passes
from services.trainer.parallel.pipeline import apply_pipeline, forward_backward_pipeline
from services.trainer.parallel.tensor_parallel import apply_tensor_parallel
from services.trainer.step import count_loss_tokens, host_to_device


def parallelize(model: nn.Module, cfg: Config, groups: ParallelGroups) -> nn.Module:
    """Apply every parallelism of `cfg.parallel` to `model` (an initialised MoETransformer), in place."""
    p = cfg.parallel
    apply_pipeline(model, groups.pp.group, p.pp_layers, p.pp_virtual, seq_len=cfg.data.seq_len)
    apply_expert_parallel(model, groups, p.dispatcher)
    bind_router_replicas(model, groups)
    apply_tensor_parallel(model, groups.tp.group, p.sequence_parallel)
    if max(groups.cp_by_size) > 1:
        apply_context_parallel(model)
    return model


def build_optimizer(model: nn.Module, cfg: Config, groups: ParallelGroups) -> DistributedOptimizer:
    return DistributedOptimizer(model, groups, cfg.optimizer, cfg.parallel.grad_bucket_mb,
                                shard=cfg.parallel.distributed_optimizer)


def set_aux_loss_scale(model: nn.Module, scale: float | torch.Tensor) -> None:
    """The gradient every MoE aux loss gets in backward: a number, or a 0-d device tensor (`AttachAuxLoss`)."""
    for m in model.modules():
        if hasattr(m, "aux_loss_scale"):
            m.aux_loss_scale = scale


def forward_backward_parallel(model: nn.Module, micro_batches: list[dict[str, torch.Tensor]], groups: ParallelGroups,
                              cfg: Config, device: torch.device, autocast_dtype: torch.dtype | None,
                              optimizer: DistributedOptimizer | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's dp rank's micro-batches (whole, unsharded; every CP peer receives them all) through forward and
    backward: those of this rank's CP share (`cp_share`: under dynamic CP each block runs its own), each sharded over
    the CP group of its size.

    Returns (summed token loss of the whole step over all ranks, loss tokens of the whole step), both 0-d tensors on
    `device` (fp32 and int64), queued, not read. The loss of every micro-batch is divided by the step's loss tokens over
    DP×CP and gradients are summed by the optimizer, so the step equals one process running all micro-batches. The MoE
    aux losses are scaled by 1 / (micro-batches of the step over DP), the single-process `1 / micro-batches`.

    Both counts are all-reduced on the device and stay there: the loss and the aux losses are divided by device
    tensors, so the host queues the step without waiting for the previous one to finish (reading the counts back would
    drain the queue at every step's start). The caller reads the token count with the step's other values.
    """
    p = cfg.parallel
    micro_batches = cp_share(micro_batches, groups.cp.size, groups.cp.rank)
    local = [shard_micro_batch(mb, groups, p.cp_comm, cfg.model.mtp_num_layers) for mb in micro_batches]
    # A micro-batch sized for c CP ranks is held by c ranks: each contributes 1/c of it to the micro-batch count.
    share = sum(1.0 / int(mb.get("cp_size", groups.cp.size)) for mb in micro_batches)
    totals = host_to_device(torch.tensor([float(count_loss_tokens(local)), share], dtype=torch.float64), device)
    step_tokens, num_micro = sum_over(totals, groups.dp_cp)  # fp64: token sums stay exact
    # max(micro-batches, 1) and max(tokens, 1) as the host numbers were, the loss divided in its dtype (fp32)
    set_aux_loss_scale(model, (1.0 / num_micro.clamp_min(1.0)).float())
    if optimizer is not None:
        optimizer.begin_step(backward_passes(len(local)) if p.ep_overlap else len(local))
    sp = groups.tp.size if p.sequence_parallel else 1
    loss = forward_backward_pipeline(model, local, step_tokens.clamp_min(1.0).float(), device, autocast_dtype,
                                     groups.pp.group, sp, pairs=p.ep_overlap)
    # The loss lives on the last stage, on every TP rank alike (vocab-parallel CE is complete after its all-reduces).
    loss = sum_over(loss.detach().float().reshape(1).clone(), groups.dp_cp, groups.pp)[0]
    return loss, step_tokens.round().long()
