"""RL training data parallel over two trainer ranks reproduces one process on the same trajectory groups.

Two gloo processes run the production path of `train_rl` — rank 0 alone holds a (fake) rollout reader and broadcasts
each step's groups as wire bytes (`SharedRollouts`); each rank trains on its round-robin share of the groups (5 groups:
3 on rank 0, 2 on rank 1) through `rl_step` with the pre-training DistributedOptimizer (ZeRO-1, several buckets) — and
one process runs `rl_step` with torch's AdamW over every group. Two steps each, on two scenarios:

- "replay_kl": one sample per micro-batch (so the MoE aux loss, a per-micro-batch term, sees the same micro-batches on
  both sides), aux loss on, recomputed old log-probs with truncated importance weights, KL to the reference model;
- "packed": micro-batches packed differently on each side (the token normalisation must not care), ratio against the
  rollout log-probs, no aux loss.

Compared: the step's loss and every metric, the global gradient norm, every parameter's (clipped) gradient each step and
every parameter after two AdamW steps. Tolerance (fp32): 1e-5 relative L2 for tensors; 1e-5 relative plus 1e-7
absolute for scalar metrics (the first step's loss is zero up to rounding).
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from services.common.config import Config
from services.common.tokenizer import load_tokenizer
from services.rl_rollout.engine import Engine, Request
from services.rl_rollout.publish import encode_group
from services.rl_rollout.sampling import SamplingParams
from services.trainer.optim import build_adamw, set_lr
from services.trainer.rl.rollouts import decode_group
from services.trainer.rl.step import rl_step
from services.trainer.rl.train_rl import reference_model
from tests.parallel_harness import spawn_ranks
from tests.rl_helpers import tiny_model, tiny_model_config

RTOL = 1e-5
ATOL = 1e-7  # for scalar metrics that are zero up to rounding (the first step's loss: ratio 1, advantages sum to 0)
TIMEOUT_S = 180.0
MODEL_SEED = 11
PROMPTS = ("12+7=", "3*4=", "9-5=", "8+8=", "7*6=")
SAMPLES = 4
METRICS = ("loss", "grad_norm", "reward", "reward_std", "response_length", "response_tokens", "clip_frac", "kl",
           "logprob_mismatch", "rollout_kl", "tis_weight", "policy_versions", "staleness_max")
SCENARIOS = {
    "replay_kl": dict(model=dict(aux_loss_coeff=1e-2), rl=dict(micro_batch_tokens=1, recompute_logprobs=True,
                                                              tis_cap=2.0, kl_coef=0.05)),
    "packed": dict(model=dict(aux_loss_coeff=0.0), rl=dict(micro_batch_tokens=40, recompute_logprobs=False,
                                                          kl_coef=0.0)),
}


def _config(scenario: str) -> Config:
    cfg = Config()
    cfg.model = tiny_model_config(**SCENARIOS[scenario]["model"])
    for k, v in SCENARIOS[scenario]["rl"].items():
        setattr(cfg.rl, k, v)
    cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.optimizer.clip_grad, cfg.optimizer.eps = 1e-3, 0.1, 0.05, 1e-6
    cfg.parallel.grad_bucket_mb = 0.05  # several buckets even for the tiny model
    return cfg


def _model(scenario: str):
    # The rollout's model (same seed and init as the engine's), in training mode as the trainer runs it.
    return tiny_model(seed=MODEL_SEED, **SCENARIOS[scenario]["model"]).train()


def _wire_steps() -> list[list[bytes]]:
    """Two steps of groups as the workers write them (version 0 both: the second step trains one version stale)."""
    tok = load_tokenizer("byte")
    steps = []
    for seed in (0, 1):
        engine = Engine(tiny_model(seed=MODEL_SEED), tok, max_batch=8, max_seq_len=64, seed=seed)
        params = SamplingParams(temperature=1.0, max_tokens=6, stop_at_eos=False)
        gen = torch.Generator().manual_seed(seed)
        wires = []
        for g, prompt in enumerate(PROMPTS):
            cs = engine.generate([Request(tok.encode(prompt), params, tag=i) for i in range(SAMPLES)])
            rewards = torch.rand(SAMPLES, generator=gen).tolist()
            msg = encode_group(f"w:{seed}:{g}", "w", 0, "test", prompt, {}, 1.0, cs, rewards)
            wires.append(msg.SerializeToString())
        engine.close()
        steps.append(wires)
    return steps


class FakeReader:
    """Rank 0's RolloutReader stand-in: hands out the prepared steps, then times out."""

    stream = "fake:stream"

    def __init__(self, steps: list[list[bytes]]):
        self.steps, self.dropped_stale, self.dropped_foreign = list(steps), 0, 0

    def next_groups(self, count, trainer_version, timeout_s=0.0):
        if not self.steps:
            raise TimeoutError("only 0 of 5 trajectory groups arrived on fake:stream within 0s")
        self.dropped_stale += 2  # counters travel with the groups
        self.dropped_foreign += 1
        return [decode_group(w) for w in self.steps.pop(0)][:count]


# ---------------------------------------------------------------- the single-process reference


def _reference(scenario: str, steps: list[list[bytes]]) -> dict:
    cfg = _config(scenario)
    model = _model(scenario)
    ref = reference_model(model, cfg)
    opt = build_adamw(model, cfg.optimizer)
    metrics, grads = [], []
    for step, wires in enumerate(steps):
        set_lr(opt, cfg.optimizer.lr)
        groups = [decode_group(w) for w in wires]
        metrics.append(rl_step(model, opt, groups, cfg.rl, torch.device("cpu"), cfg.optimizer.clip_grad, ref,
                               version=step + 1, lr=cfg.optimizer.lr))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})  # clipped in place by rl_step
    return {"metrics": metrics, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


# ---------------------------------------------------------------- the data-parallel run


def _worker(rank: int, world: int, steps: list[list[bytes]], out_dir: str) -> None:
    from services.trainer.parallel.groups import init_groups
    from services.trainer.parallel.parallelize import build_optimizer, parallelize
    from services.trainer.rl.shared import SharedRollouts

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    out = {}
    try:
        for scenario in SCENARIOS:
            cfg = _config(scenario)
            groups = init_groups(cfg)
            model = _model(scenario)
            parallelize(model, cfg, groups)
            ref = reference_model(model, cfg)
            opt = build_optimizer(model, cfg, groups)
            rollouts = SharedRollouts(FakeReader(steps) if rank == 0 else None, torch.device("cpu"))
            metrics, grads, seen, dropped = [], [], [], []
            for step in range(len(steps)):
                step_groups = rollouts.next_groups(len(PROMPTS), step + 1)
                seen.append([(g.group_id, [s.tokens for s in g.samples]) for g in step_groups])
                dropped.append((rollouts.dropped_stale, rollouts.dropped_foreign))
                m = rl_step(model, opt, step_groups, cfg.rl, torch.device("cpu"), cfg.optimizer.clip_grad, ref,
                            version=step + 1, lr=cfg.optimizer.lr)
                metrics.append(m)
                coef = min(1.0, cfg.optimizer.clip_grad / (m["grad_norm"] + 1e-6))  # as the optimizer clips
                grads.append({n: g * coef for n, g in opt.full_grads().items()})
            try:
                rollouts.next_groups(len(PROMPTS), len(steps) + 1)
                failure = None
            except (TimeoutError, RuntimeError) as e:
                failure = (type(e).__name__, str(e))
            opt.wait_params()  # the last step's parameter all-gathers (a next forward would wait for them)
            out[scenario] = {"metrics": metrics, "grads": grads, "seen": seen, "dropped": dropped,
                             "failure": failure, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run_parallel(steps: list[list[bytes]], world: int, out_dir: str) -> list[dict]:
    return spawn_ranks(_worker, (world, steps, out_dir), world, out_dir, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    steps = _wire_steps()
    ranks = _run_parallel(steps, world=2, out_dir=str(tmp_path_factory.mktemp("rl_dp2")))
    return {s: _reference(s, steps) for s in SCENARIOS}, ranks


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def _close(a, b) -> bool:
    if isinstance(a, list):
        return a == b
    return abs(a - b) <= ATOL + RTOL * abs(b) if b is not None else a is None


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_dp2_rl_steps_match_one_process_loss_metrics_gradients_and_params(runs, scenario):
    refs, ranks = runs
    ref = refs[scenario]
    for r, rank in enumerate(ranks):
        par = rank[scenario]
        for step, (mr, mp_) in enumerate(zip(ref["metrics"], par["metrics"], strict=True)):
            for k in METRICS:
                assert _close(mp_[k], mr[k]), f"rank {r} step {step}: {k} {mp_[k]} != one process's {mr[k]}"
        for step, (gr, gp) in enumerate(zip(ref["grads"], par["grads"], strict=True)):
            assert gp.keys() == gr.keys()
            for name in gr:
                err = _rel_err(gp[name], gr[name])
                assert err <= RTOL, f"rank {r} step {step}: gradient of {name} differs by {err:.2e} (relative)"
        for name, p in ref["params"].items():
            err = _rel_err(par["params"][name], p)
            assert err <= RTOL, f"rank {r}: parameter {name} after 2 steps differs by {err:.2e} (relative)"
    # The scenario exercises what it claims: clipping, a policy gradient, and (replay_kl) a KL term and stale old
    # log-probs different from the rollout's.
    assert all(m["grad_norm"] > _config(scenario).optimizer.clip_grad for m in ref["metrics"])
    if scenario == "replay_kl":
        assert ref["metrics"][1]["kl"] > 0 and ref["metrics"][1]["logprob_mismatch"] > 1e-4


def test_every_rank_receives_rank_0s_groups_and_dropped_counters(runs):
    _, ranks = runs
    for scenario in SCENARIOS:
        seen = [rank[scenario]["seen"] for rank in ranks]
        assert seen[0] == seen[1] and len(seen[0][0]) == len(PROMPTS)
        assert [rank[scenario]["dropped"] for rank in ranks] == [[(2, 1), (4, 2)]] * 2


def test_a_failed_read_on_rank_0_fails_every_rank_instead_of_hanging(runs):
    _, ranks = runs
    lead, other = (rank["packed"]["failure"] for rank in ranks)
    assert lead[0] == "TimeoutError" and "within" in lead[1]
    assert other[0] == "TimeoutError" and "rank 0 could not read" in other[1]
