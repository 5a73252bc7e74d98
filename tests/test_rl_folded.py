"""RL steps on folded layouts (TP with sequence parallelism, EP, ETP) reproduce one process on the same trajectories.

The trajectory groups are fixed: generated once by the rollout engine from the tiny model (completions, the routing it
chose for every token, its log-probs) with seeded rewards, as in tests/test_rl_parallel.py. Every layout runs two
`rl_step`s with the pre-training DistributedOptimizer, each DP replica on the micro-batches the dataloader's RL source
deals it (`pack_step` for the layout's dp size, each micro-batch with the CP size the source gives it: `cp_size`;
the TP ranks of a replica get the same), against one process running
`rl_step` with torch's AdamW on the dp_size=1 micro-batches of the same groups, and after each step the full weights are gathered to rank 0 by `WeightGather` (the publish path). Layouts:

- 2 ranks: TP2 (vocab-parallel log-probs, sequence-parallel padding: the samples' 9- and 10-token sequences are odd and
  even) and EP2 (= DP2: the EP all-to-alls pair two replicas with different shares);
- 4 ranks: TP2·EP2 (DP2; EP inside each TP pair) and EP2·ETP2 (DP4: EP across replicas again, and ETP's partial sums);
- EP2 with `parallel.ep_overlap`: every pass's micro-batches in interleaved pairs (the old and reference log-prob
  passes forward only, then the policy loss), counted by pass (each rank records the units it interleaves), with
  fillers in a pair and alone (the second replica packs its share finer: `UNEVEN`).
In the first four the dataloader deals every replica equally many micro-batches (EP2 and TP2·EP2: 10 per step in
"replay_kl", 3 in "packed"; EP2·ETP2: 5 and 2), so no rank adds filler micro-batches (`folded.with_fillers`): here
fillers come only with the test-only `UNEVEN` key, in the `parallel.ep_overlap` layout.

Pipeline layouts run through the same harness (`run_and_compare`) in tests/test_rl_pipeline.py.

Two scenarios each: "replay_kl" (one sample per micro-batch, recomputed old log-probs with truncated importance
weights, KL to a reference model copied from the parallelized policy, the router's micro-batch aux loss and z-loss on:
with TP the odd 9-token samples are padded by one token, which the routers leave out of both, see rl/folded.py) and
"packed" (several samples per micro-batch, ratio against the rollout log-probs, no aux or z loss: the DP replicas
pack other micro-batches than one process). The `parallel.ep_overlap` layouts run "packed_kl" for "packed": packed
micro-batches with the recomputed old log-probs and the reference KL of "replay_kl", so an odd count of micro-batches
and fillers go through the forward-only passes too. Compared: every metric of every step, every weight after every
step, and exactly, each MoE layer's load (`Router.tokens_per_expert`, summed over the ranks) after both steps.
Tolerance (fp32): 1e-5 relative L2 for weights, 1e-5 relative plus 1e-7 absolute for scalar metrics — the
parallel sides sum in other orders (TP row-parallel partial sums, all-reduced softmax statistics), nothing more —
except `logprob_mismatch` before the first update: the mean |log-prob - rollout log-prob| of the very policy that
generated, i.e. fp32 rounding alone (~4e-7 here), which a different summation order changes by as much as itself. It
gets 1e-6 absolute, a few fp32 ulps of log-probs of magnitude 1-10 (measured: 3.9e-7 one process, 5.5e-7 folded, in
a fresh environment at 82eb50a; earlier sessions' environments agreed within 1e-7). So does the loss: a mean over
tokens of terms of magnitude ~1 (advantage x ratio) that cancel to ~1e-7 at the first step, where a summation order
moves it by as much as itself (measured after the rollout sampler changed the test's trajectories: -8.5e-8 one
process, 9.0e-8 under CP2).
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from services.common.config import Config, ConfigError, validate
from services.trainer.rl.step import rl_step
from services.trainer.rl.train_rl import reference_model, validate_rl
from tests.parallel_harness import spawn_ranks
from tests.rl_helpers import micro_batches, single_process_rl_steps, tiny_model, tiny_model_config
from tests.test_rl_parallel import METRICS, MODEL_SEED, _steps

RTOL = 1e-5
ATOL = 1e-7
# fp32 rounding of log-probs, and of the loss, a token mean of advantage-weighted ratios whose terms cancel to ~1e-7
# (a group's advantages sum to zero): see the module docstring
ATOL_OF = {"logprob_mismatch": 1e-6, "loss": 1e-6}
TIMEOUT_S = 300.0
LAYOUTS = {2: [dict(tp=2), dict(ep=2)], 4: [dict(tp=2, ep=2), dict(ep=2, etp=2)]}
SCENARIOS = {
    "replay_kl": dict(micro_batch_tokens=1, recompute_logprobs=True, tis_cap=2.0, kl_coef=0.05),
    "packed": dict(micro_batch_tokens=40, recompute_logprobs=False, kl_coef=0.0),
    "packed_kl": dict(micro_batch_tokens=40, recompute_logprobs=True, tis_cap=2.0, kl_coef=0.05),
}
BASE_SCENARIOS = ("replay_kl", "packed")  # what every layout runs; "packed_kl": the `parallel.ep_overlap` layouts
# The router's losses of each scenario: on where both sides run the same micro-batches (one sample each), padded or not
ROUTER_LOSSES = {"replay_kl": dict(aux_loss_coeff=1e-2, z_loss_coeff=1e-2),
                 "packed": dict(aux_loss_coeff=0.0, z_loss_coeff=0.0),
                 "packed_kl": dict(aux_loss_coeff=0.0, z_loss_coeff=0.0)}


# A test-only layout key: the last dp rank packs its share into micro-batches of half `rl.micro_batch_tokens` (where a
# micro-batch holds several samples: "packed"), so it runs more of them and the others add fillers to match its count
UNEVEN = "uneven_packing"


def _finer(cfg: Config, layout: dict, dp) -> tuple[int, int] | None:
    return (dp.size - 1, max(1, cfg.rl.micro_batch_tokens // 2)) if layout.get(UNEVEN) else None


def _config(layout: dict, scenario: str) -> Config:
    cfg = Config()
    cfg.rl.enabled = True  # an RL run's config (validated as one: e.g. `parallel.ep_overlap` without data.grad_accum)
    cfg.model = tiny_model_config(**ROUTER_LOSSES[scenario])
    for k, v in SCENARIOS[scenario].items():
        setattr(cfg.rl, k, v)
    cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.optimizer.clip_grad, cfg.optimizer.eps = 1e-3, 0.1, 0.05, 1e-6
    cfg.parallel.grad_bucket_mb = 0.05
    for k, v in layout.items():  # `parallel.*` keys, and the dynamic CP budget's `data.cp_max_*`
        if k == UNEVEN:
            continue
        setattr(cfg.data if k.startswith("cp_max_") else cfg.parallel, k, v)
    return cfg


def _model(aux: float, z: float = 0.0):
    return tiny_model(seed=MODEL_SEED, aux_loss_coeff=aux, z_loss_coeff=z).train()


def _reference(scenario: str, steps: list[list]) -> dict:
    cfg = _config(dict(), scenario)
    model = _model(cfg.model.aux_loss_coeff, cfg.model.z_loss_coeff)
    metrics, weights = [], []
    for m in single_process_rl_steps(model, cfg, steps):
        metrics.append(m)
        weights.append({n: t.clone() for n, t in model.state_dict().items()})
    return {"metrics": metrics, "weights": weights, "load": _router_loads(model)}


def _router_loads(model) -> dict[int, torch.Tensor]:
    """Every MoE layer's accumulated load (`Router.tokens_per_expert`, what the bias update reads), by layer id."""
    ids = [block.layer_id for block in model.layers.values() if block.is_moe]
    return {i: m.router.tokens_per_expert.clone() for i, m in zip(ids, model.moe_layers(), strict=True)}


def _record_cuts(cuts: list[int]) -> None:
    """Append the CP group size of every micro-batch `rl_step` cuts on this rank to `cuts` (1: run uncut)."""
    import services.trainer.rl.step as step_module

    cp_shard = step_module.cp_shard

    def recorded(mb, cp, *args):
        cuts.append(cp.size)
        return cp_shard(mb, cp, *args)

    step_module.cp_shard = recorded


def _record_units(units: list[tuple[str, int]]) -> None:
    """Append (pass, size) of every unit of interleaved forwards (`parallel.ep_overlap`; size 2 for a pair, 1 for a
    lone last micro-batch) this rank's steps run to `units`; pass: "old" and "ref" for the forward-only log-prob
    passes of the policy and of the reference model (frozen: no trainable parameter), "loss" for the policy loss."""
    import services.trainer.parallel.micro_batch_pairs as pairs_module
    import services.trainer.rl.step as step_module

    interleave, logprobs = pairs_module.interleave, step_module.pipeline_logprobs
    current = ["loss"]

    def recorded(stages, *args):
        units.append((current[0], len(stages)))
        return interleave(stages, *args)

    def labelled(model, *args, **kwargs):
        current[0] = "old" if any(p.requires_grad for p in model.parameters()) else "ref"
        try:
            return logprobs(model, *args, **kwargs)
        finally:
            current[0] = "loss"

    pairs_module.interleave = recorded
    step_module.pipeline_logprobs = labelled


def _worker(rank: int, world: int, layouts: list[dict], steps: list[list], out_dir: str,
            scenarios: tuple[str, ...]) -> None:
    from services.trainer.parallel.expert_parallel import sync_expert_load
    from services.trainer.parallel.gather_weights import WeightGather
    from services.trainer.parallel.groups import init_groups
    from services.trainer.parallel.parallelize import build_optimizer, parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    out, cuts, units = {}, [], []
    _record_cuts(cuts)
    _record_units(units)
    try:
        for layout in layouts:
            for scenario in scenarios:
                cuts.clear()
                units.clear()
                cfg = _config(layout, scenario)
                groups = init_groups(cfg)
                model = parallelize(_model(cfg.model.aux_loss_coeff, cfg.model.z_loss_coeff), cfg, groups)
                ref = reference_model(model, cfg, groups)
                opt = build_optimizer(model, cfg, groups)
                gather = WeightGather(model, groups)
                metrics, weights = [], []
                for step, step_groups in enumerate(steps):
                    data = micro_batches(step_groups, dp_size=groups.dp.size, max_tokens=cfg.rl.micro_batch_tokens,
                                         cp_cfg=cfg, finer=_finer(cfg, layout, groups.dp))[groups.dp.rank]
                    metrics.append(rl_step(model, opt, data, cfg.rl, torch.device("cpu"), cfg.optimizer.clip_grad,
                                           ref, version=step, lr=cfg.optimizer.lr,
                                           cp_comm=cfg.parallel.cp_comm, ep_overlap=cfg.parallel.ep_overlap).read())
                    weights.append(gather.state_dict())
                sync_expert_load(model, groups)  # the stage's load over TP and DP×CP, as train_rl sums it
                out[(str(layout), scenario)] = {"metrics": metrics, "weights": weights, "cuts": list(cuts),
                                                "units": list(units), "load": _router_loads(model)}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def steps():
    return _steps()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def _close(a, b, metric: str = "") -> bool:
    if isinstance(a, list):
        return a == b
    return abs(a - b) <= ATOL_OF.get(metric, ATOL) + RTOL * abs(b) if b is not None else a is None


def run_and_compare(world: int, layouts: list[dict], steps: list[list], out_dir: str,
                    scenarios: tuple[str, ...] = BASE_SCENARIOS) -> list[dict]:
    """Run `layouts` on `world` gloo ranks (`_worker`) and compare every rank's metrics and rank 0's gathered weights
    with one process, in each of `scenarios`. Returns each rank's results by (str(layout), scenario): "metrics",
    "weights", "cuts" (the CP group size of every micro-batch the rank ran, in order, over the steps) and "units" (the
    pass and size of every unit of interleaved forwards it ran, `parallel.ep_overlap`: `_record_units`)."""
    ranks = spawn_ranks(_worker, (world, layouts, steps, out_dir, scenarios), world, out_dir, timeout_s=TIMEOUT_S)
    refs = {scenario: _reference(scenario, steps) for scenario in scenarios}
    for layout in layouts:
        for scenario in scenarios:
            ref = refs[scenario]
            key = (str(layout), scenario)
            for r, rank in enumerate(ranks):
                for step, (mr, mp_) in enumerate(zip(ref["metrics"], rank[key]["metrics"], strict=True)):
                    for k in METRICS:
                        assert _close(mp_[k], mr[k], k), f"{key} rank {r} step {step}: {k} {mp_[k]} != {mr[k]}"
            for step, (wr, wp) in enumerate(zip(ref["weights"], ranks[0][key]["weights"], strict=True)):
                assert list(wp) == list(wr), f"{key}: published names differ from the single-process state_dict"
                for name, t in wr.items():
                    err = _rel_err(wp[name], t)
                    assert err <= RTOL, f"{key} step {step}: weight {name} differs by {err:.2e} (relative)"
            assert all(rank[key]["weights"] == [None] * len(steps) for rank in ranks[1:])
            for r, rank in enumerate(ranks):  # the routers' load over both steps (fillers' and padding left out)
                for layer, load in rank[key]["load"].items():
                    assert torch.equal(load, ref["load"][layer]), f"{key} rank {r}: layer {layer}'s load differs"
            # the scenario exercises what it claims: clipping, and (with a reference) a KL term and stale old log-probs
            assert all(m["grad_norm"] > 0.05 for m in ref["metrics"])
            if SCENARIOS[scenario]["kl_coef"] > 0:
                assert ref["metrics"][1]["kl"] > 0 and ref["metrics"][1]["logprob_mismatch"] > 1e-4
    return ranks


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_folded_rl_steps_match_one_process_metrics_and_published_weights(world, steps, tmp_path):
    run_and_compare(world, LAYOUTS[world], steps, str(tmp_path))


# The units of interleaved forwards each rank runs per step under `parallel.ep_overlap` with `UNEVEN` packing, pass by
# pass (`_record_units`), in EP2 and PP2·EP2 (tests/test_rl_pipeline.py): "replay_kl" has 10 one-sample micro-batches
# per rank, five pairs in each pass; "packed_kl" 3 on the first rank and 5 on the second, so the first pairs a
# micro-batch with a filler and runs a lone filler, in every pass.
OVERLAP_SCENARIOS = ("replay_kl", "packed_kl")
OVERLAP_UNITS = {"replay_kl": [("old", 2)] * 5 + [("ref", 2)] * 5 + [("loss", 2)] * 5,
                 "packed_kl": [("old", 2), ("old", 2), ("old", 1), ("ref", 2), ("ref", 2), ("ref", 1),
                               ("loss", 2), ("loss", 2), ("loss", 1)]}


def assert_overlap_units(ranks: list[dict], layout: dict, steps: int) -> None:
    """Every rank ran OVERLAP_UNITS' interleaved units (pass, micro-batches) in every step of every scenario."""
    for scenario in OVERLAP_SCENARIOS:
        want = OVERLAP_UNITS[scenario] * steps
        for r, rank in enumerate(ranks):
            units = rank[(str(layout), scenario)]["units"]
            assert units == want, f"{scenario} rank {r}: interleaved units {units}, not {want}"


def test_ep2_with_ep_overlap_pairs_every_pass_s_micro_batches_and_matches_one_process(steps, tmp_path):
    """`parallel.ep_overlap` on EP2 (= DP2): each rank's micro-batches go through interleaved pairs (rl/pipelined.py),
    an odd last one alone, in the old and reference log-prob passes (forward only) and in the policy loss, with every
    metric, every weight and the routers' load as one process's within the module's tolerance. The fillers pair in
    every pass, as the EP peers' all-to-alls must; a filler's load must stay out while the other micro-batch counts."""
    layout = {"ep": 2, "ep_overlap": True, UNEVEN: True}
    ranks = run_and_compare(2, [layout], steps, str(tmp_path), OVERLAP_SCENARIOS)
    assert_overlap_units(ranks, layout, len(steps))


def test_rl_config_accepts_ep_overlap_with_expert_parallelism_whatever_grad_accum_says():
    cfg = Config()
    cfg.rl.enabled, cfg.run.nproc, cfg.parallel.ep, cfg.parallel.ep_overlap = True, 2, 2, True
    validate(cfg, 2)  # an RL step's micro-batch count is the dataloader's packing, not data.grad_accum (1 here)
    validate_rl(cfg)
    cfg.parallel.ep = 1
    with pytest.raises(ConfigError, match="needs `parallel.ep` > 1"):
        validate(cfg, 2)
