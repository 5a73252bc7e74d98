"""Routing replay: the expert ids a rollout recorded, put back into the routers of the model that re-evaluates it.

The rollout engine records one row of ids per MoE layer of the whole model, in layer order: [MoE layers, T, k]
(services/rl_rollout/kv_cache.py). A pipeline stage holds only some layers, so each owned MoE layer takes its row by
its layer id — the MoE layers are the blocks from `model.first_k_dense` on (`model.transformer.Block`), so layer l's row
is l - first_k_dense. On a whole model that is every row, in `model.moe_layers()` order.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


def recorded_moe_layers(cfg) -> int:
    """Rows of a recorded routing for a model of config `cfg`: its MoE layers."""
    return cfg.num_layers - min(cfg.first_k_dense, cfg.num_layers)


def owned_routing(model: nn.Module, routing: torch.Tensor) -> torch.Tensor:
    """The rows of `routing` [MoE layers of the whole model, T, k] for the MoE layers `model` (a whole model or a
    pipeline stage) holds, in `model.moe_layers()` order."""
    total = recorded_moe_layers(model.cfg)
    if routing.shape[0] != total:
        raise ValueError(f"recorded routing covers {routing.shape[0]} MoE layers, the model has {total}")
    rows = [block.layer_id - model.cfg.first_k_dense for block in model.layers.values() if block.is_moe]
    if rows == list(range(total)):
        return routing
    return routing[torch.tensor(rows, dtype=torch.long, device=routing.device)]


@contextmanager
def routing_replay(model: nn.Module, routing: torch.Tensor):
    """Make every MoE layer of `model` use its recorded expert ids (`routing`: [MoE layers of the whole model, T, k]).
    """
    layers = model.moe_layers()
    ids = owned_routing(model, routing)
    try:
        for layer, layer_ids in zip(layers, ids, strict=True):
            layer.router.replay_ids = layer_ids
        yield
    finally:
        for layer in layers:
            layer.router.replay_ids = None
