"""RL steps on pipeline-parallel layouts reproduce one process on the same trajectories.

The harness is tests/test_rl_folded.py's (same trajectory groups, scenarios, single-process reference, comparison and
tolerance: 1e-5 relative L2 for the weights rank 0 gathers after each step, 1e-5 relative plus 1e-7 absolute for every
metric on every rank). Layouts, on the 3-layer tiny model (layer 0 dense, layers 1 and 2 MoE; two stages split it
[0, 1] | [2], so each stage replays a different row of the recorded routing):

- 2 ranks: PP2 (the old/reference log-probs by forward-only pipeline passes, the policy loss in the last stage's 1F1B);
- 4 ranks: PP2·TP2 (vocab-parallel log-probs and sequence-parallel padding on the last stage, hidden states split over
  TP between stages) and PP2·EP2 (DP2: each stage's EP all-to-alls pair two replicas, which the dataloader deals
  equally many micro-batches, so neither adds fillers), and PP2·EP2 with `parallel.ep_overlap` (pairs as the units of
  the forward-only log-prob passes and of the 1F1B policy loss; the second replica packs its share finer,
  test_rl_folded.UNEVEN, so fillers run in them, through the pipeline).

"replay_kl" has the reference model `frozen_copy`-ed from each rank's pipeline stage, and its old log-probs
recomputed: a stage that replayed the wrong rows, or a reference that were not the same stage, would move the KL, the
importance weights and the weights.
"""

from __future__ import annotations

import pytest
import torch

from services.common.config import Config
from services.trainer.rl.replay import owned_routing, routing_replay
from services.trainer.rl.train_rl import validate_rl
from tests.rl_helpers import tiny_model
from tests.test_rl_folded import OVERLAP_SCENARIOS, UNEVEN, assert_overlap_units, run_and_compare
from tests.test_rl_parallel import _steps

LAYOUTS = {2: [dict(pp=2)], 4: [dict(pp=2, tp=2), dict(pp=2, ep=2)]}


@pytest.fixture(scope="module")
def steps():
    return _steps()


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_pipeline_rl_steps_match_one_process_metrics_and_published_weights(world, steps, tmp_path):
    run_and_compare(world, LAYOUTS[world], steps, str(tmp_path))


def test_pp2_ep2_with_ep_overlap_moves_pairs_through_every_pass_and_matches_one_process(steps, tmp_path):
    """`parallel.ep_overlap` under PP2·EP2 (DP2): the units of the forward-only old and reference log-prob passes and
    of the policy loss's 1F1B are pairs of micro-batches on both stages, fillers included (the second replica packs
    its share finer, test_rl_folded.UNEVEN), an odd last one alone."""
    layout = {"pp": 2, "ep": 2, "ep_overlap": True, UNEVEN: True}
    ranks = run_and_compare(4, [layout], steps, str(tmp_path), OVERLAP_SCENARIOS)
    assert_overlap_units(ranks, layout, len(steps))


def test_a_stage_replays_the_recorded_rows_of_its_own_moe_layers():
    model = tiny_model(seed=0)  # layer 0 dense; layers 1, 2 MoE: rows 0, 1 of a recording
    del model.layers["0"], model.layers["1"]  # the second of two stages: layer 2 only
    model.embed = None
    routing = torch.stack([torch.zeros(5, 2, dtype=torch.int64), torch.ones(5, 2, dtype=torch.int64)])
    assert torch.equal(owned_routing(model, routing), routing[1:])
    with routing_replay(model, routing):
        assert torch.equal(model.moe_layers()[0].router.replay_ids, routing[1])
    assert model.moe_layers()[0].router.replay_ids is None
    with pytest.raises(ValueError, match="covers 1 MoE layers, the model has 2"):
        owned_routing(model, routing[1:])  # a recording is of the whole model, whatever the stage holds


def test_rl_config_accepts_pipeline_stages_with_static_and_dynamic_context_parallelism():
    cfg = Config()
    cfg.rl.enabled, cfg.run.nproc, cfg.parallel.pp = True, 2, 2
    validate_rl(cfg)
    cfg.parallel.cp = 2
    cfg.run.nproc = 4
    validate_rl(cfg)  # pp2 x cp2: tests/test_rl_cp.py
    cfg.parallel.cp_sizes = [1, 2]
    validate_rl(cfg)  # dynamic: tests/test_rl_cp.py too
