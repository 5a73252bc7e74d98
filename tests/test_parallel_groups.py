"""Rank layouts of Parallel Folding, computed without torch.distributed: TP innermost then CP, DP, PP on the attention
side; ETP innermost then EP, EDP on the MoE side; both sides share the PP stages. Invalid layouts fail naming the sizes.
"""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist

from services.common.config import Config, ConfigError
from services.trainer.parallel.groups import (coordinates, init_groups, make_layout, rank_layout, single_process,
                                              ATTENTION_AXES, MOE_AXES)


def _cfg(**parallel) -> Config:
    cfg = Config()
    cfg.model.num_experts = 16
    cfg.model.num_kv_heads = 4
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


def _layout(world: int, **parallel):
    return make_layout(_cfg(**parallel), world)


def _assert_partition(groups, world):
    assert sorted(itertools.chain.from_iterable(groups)) == list(range(world)), groups


def test_folded_ep4_over_dp2_tp2_puts_tp_pairs_inside_each_ep_group():
    lists = rank_layout(_layout(8, tp=2, ep=4))
    assert lists["tp"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert lists["dp"] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert lists["ep"] == [(0, 1, 2, 3), (4, 5, 6, 7)]  # EP spans TP and DP ranks: EP exceeds DP
    assert lists["edp"] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert lists["etp"] == [(r,) for r in range(8)]
    assert lists["ep_etp"] == lists["ep"]


def test_attention_order_is_tp_then_cp_then_dp_then_pp():
    layout = _layout(16, tp=2, cp=2, pp=2)
    assert layout.dp == 2
    lists = rank_layout(layout)
    assert lists["tp"][0] == (0, 1)
    assert lists["cp"][0] == (0, 2)
    assert lists["dp"][0] == (0, 4)
    assert lists["dp_cp"][0] == (0, 2, 4, 6)  # group rank = dp * cp + cp_rank
    assert lists["pp"][0] == (0, 8)
    for r in range(16):
        c = coordinates(layout, r, ATTENTION_AXES)
        assert r == ((c["pp"] * layout.dp + c["dp"]) * layout.cp + c["cp"]) * layout.tp + c["tp"]


def test_moe_order_is_etp_then_ep_then_edp_and_shares_the_pipeline_stages():
    layout = _layout(16, tp=2, cp=2, pp=2, ep=2, etp=2)
    lists = rank_layout(layout)
    assert layout.edp == 2
    assert lists["etp"][0] == (0, 1)
    assert lists["ep"][0] == (0, 2)
    assert lists["edp"][0] == (0, 4)
    assert lists["ep_etp"][0] == (0, 1, 2, 3)  # group rank = ep * etp + etp_rank
    for r in range(16):  # same stage on both sides
        assert coordinates(layout, r, ATTENTION_AXES)["pp"] == coordinates(layout, r, MOE_AXES)["pp"]


@pytest.mark.parametrize("world,parallel", [
    (8, dict(tp=2, ep=4)), (8, dict(ep=8)), (8, dict(tp=4, ep=2, etp=2)), (16, dict(tp=2, cp=2, pp=2, ep=4)),
    (4, dict(ep=2, etp=2)), (12, dict(tp=2, pp=3, ep=2)), (8, dict(cp=4, cp_sizes=[1, 2, 4], ep=4)),
])
def test_every_axis_partitions_the_world_and_groups_have_the_axis_size(world, parallel):
    layout = _layout(world, **parallel)
    lists = rank_layout(layout)
    sizes = dict(tp=layout.tp, cp=layout.cp, dp=layout.dp, dp_cp=layout.dp * layout.cp, pp=layout.pp,
                 etp=layout.etp, ep=layout.ep, edp=layout.edp, ep_etp=layout.ep * layout.etp, **{f"cp{c}": c for c in layout.cp_sizes})
    assert set(lists) == set(sizes)
    for name, groups in lists.items():
        _assert_partition(groups, world)
        assert {len(g) for g in groups} == {sizes[name]}, name
    # each rank's dense replicas (dp_cp) times its TP peers times its stage peers cover the world exactly once
    assert layout.tp * layout.cp * layout.dp * layout.pp == world == layout.etp * layout.ep * layout.edp * layout.pp


def test_dynamic_cp_groups_are_aligned_blocks_of_the_cp_axis():
    lists = rank_layout(_layout(8, tp=2, cp=4, cp_sizes=[1, 2]))
    assert lists["cp4"] == lists["cp"] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert sorted(lists["cp2"]) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert sorted(lists["cp1"]) == [(r,) for r in range(8)]


@pytest.mark.parametrize("world,parallel,message", [
    (6, dict(tp=4), "pp*tp*cp"),
    (8, dict(ep=3), "parallel.ep=3"),
    (4, dict(ep=8, etp=1), "etp*ep"),
    (8, dict(pp=3), "pp"),
    (8, dict(cp=4, cp_sizes=[3]), "cp_sizes"),
    (12, dict(pp=2, tp=4), "tp*cp"),
])
def test_invalid_layouts_fail_at_start_naming_the_sizes(world, parallel, message):
    with pytest.raises(ConfigError, match=message.replace("*", r"\*")):
        _layout(world, **parallel)


def test_single_process_instance_has_every_axis_of_one_rank_and_no_groups():
    g = init_groups(Config(), world_size=1)
    assert g == single_process(Config())
    for name in ("tp", "cp", "dp", "dp_cp", "pp", "etp", "ep", "edp", "ep_etp", "world"):
        axis = getattr(g, name)
        assert (axis.size, axis.rank, axis.group) == (1, 0, None)
    assert g.cp_of(1) is g.cp and g.is_first_stage and g.is_last_stage
    assert not dist.is_initialized()


def test_single_process_refuses_a_parallel_config():
    with pytest.raises(ConfigError, match="ep=2"):
        single_process(_cfg(ep=2))
