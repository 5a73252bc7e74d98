"""Binding a micro-batch's context-parallel layout (`context_parallel.bind_layout`) through the modules listed when the
cores are swapped in (`CPModules`), not a walk of the model at every bind: it reaches exactly the attention cores and
routers a walk finds (a whole model and each pipeline stage, multi-token prediction's blocks included, built on the
meta device as the trainer builds them), unbinding leaves them as they were, a copy binds its own modules only, and a
model without context parallelism has nothing to bind."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.common.config import ModelConfig
from services.trainer.model.initial_weights import materialize, parameters_on_meta
from services.trainer.model.moe.router import Router
from services.trainer.model.recompute import apply_memory_policy
from services.trainer.model.transformer import MoETransformer
from services.trainer.parallel.context_parallel import (CPLayout, ContextParallelAttention, apply_context_parallel,
                                                        bind_layout)
from services.trainer.parallel.pipeline import keep_stage
from services.trainer.rl.folded import frozen_copy, needs_folded_forward

CPU = torch.device("cpu")
GROUP = object()  # stands for a CP process group: binding hands it to the routers and nothing more


def cfg() -> ModelConfig:
    return ModelConfig(num_layers=4, first_k_dense=1, mtp_num_layers=1)  # a dense layer (no router), an MTP block


def layout() -> CPLayout:
    return CPLayout(GROUP, 0, 2, torch.zeros(16, dtype=torch.int64))


def cp_model(stage: tuple[int, int] | None, recompute: list[str] = ()) -> MoETransformer:
    """Built as the trainer builds it (train.py `build_model`, parallelize.py): on the meta device, cut to the pipeline
    stage, the cores swapped in last, then given memory; then the memory policy (`model.recompute`), as train.py
    applies it."""
    with parameters_on_meta():
        model = MoETransformer(cfg())
    if stage is not None:
        keep_stage(model, *stage, seq_len=32)
    apply_context_parallel(model)
    materialize(model, CPU)
    return apply_memory_policy(model, list(recompute), [])


def walk(model: torch.nn.Module, kind: type) -> list:
    return [m for m in model.modules() if isinstance(m, kind)]


@pytest.mark.parametrize("recompute", [[], ["attn_core"]], ids=["kept", "recomputed-core"])
@pytest.mark.parametrize("stage", [None, (2, 0), (2, 1)], ids=["whole", "first-stage", "last-stage"])
def test_binding_reaches_exactly_the_cores_and_routers_a_walk_finds_and_unbinding_restores_them(stage, recompute):
    """Recomputing the core (`model.recompute: [attn_core]`, applied after the cores are swapped in) keeps each core
    where it is: the list still holds the cores the model runs."""
    model = cp_model(stage, recompute)
    cores, routers = walk(model, ContextParallelAttention), walk(model, Router)
    assert len(cores) == len(model.layers) + (len(model.mtp) if model.mtp is not None else 0) > 0
    assert len(routers) == sum(block.is_moe for block in model.layers.values()) + (
        len(model.mtp) if model.mtp is not None else 0)
    assert {id(m) for m in model.cp_modules.cores} == {id(m) for m in cores}
    assert {id(block.attn.core) for block in model.layers.values()} <= {id(m) for m in cores}
    assert {id(m) for m in model.cp_modules.routers} == {id(m) for m in routers}
    bound = layout()
    bind_layout(model, bound, CPU)
    assert all(m.layout is bound for m in cores) and all(m.cp_group is GROUP for m in routers)
    bind_layout(model, None, CPU)
    assert all(m.layout is None for m in cores) and all(m.cp_group is None for m in routers)


def test_a_copy_binds_its_own_cores_and_routers_and_leaves_the_originals_alone():
    model = cp_model(None)
    reference = frozen_copy(model)  # RL's reference policy
    bound = layout()
    bind_layout(reference, bound, CPU)
    assert all(m.layout is bound for m in walk(reference, ContextParallelAttention))
    assert all(m.cp_group is GROUP for m in walk(reference, Router))
    assert all(m.layout is None for m in walk(model, ContextParallelAttention))
    assert all(m.cp_group is None for m in walk(model, Router))
    bind_layout(model, bound, CPU)
    bind_layout(reference, None, CPU)
    assert all(m.layout is bound for m in walk(model, ContextParallelAttention))
    assert all(m.layout is None for m in walk(reference, ContextParallelAttention))


def test_an_uncut_micro_batch_takes_the_folded_forward_on_a_context_parallel_model_and_its_copies_only():
    uncut = SimpleNamespace(cp_layout=None)
    model = cp_model((2, 1))
    assert needs_folded_forward(model, uncut) and needs_folded_forward(frozen_copy(model), uncut)
    assert not needs_folded_forward(MoETransformer(cfg()), uncut)


def test_context_parallelism_after_the_memory_policy_is_refused():
    """Swapping the cores would drop the recompute wrapped around the single-device ones; the order is parallelize,
    then the policy (train.py)."""
    model = apply_memory_policy(MoETransformer(cfg()), ["attn_core"], [])
    with pytest.raises(RuntimeError, match="parallelize first, then apply the policy"):
        apply_context_parallel(model)


def test_a_model_without_context_parallelism_binds_nothing_and_refuses_a_cut_micro_batch():
    model = MoETransformer(cfg())
    bind_layout(model, None, CPU)
    assert all(m.cp_group is None for m in walk(model, Router))
    with pytest.raises(RuntimeError, match="apply_context_parallel"):
        bind_layout(model, layout(), CPU)
