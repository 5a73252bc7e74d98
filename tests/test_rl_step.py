"""The RL step: trajectories round-trip through the wire format, routing replay makes the trainer evaluate the network
that generated them, and a GRPO step moves probability towards rewarded samples independently of micro-batching."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from services.common.config import RLConfig
from services.common.tokenizer import load_tokenizer
from services.rl_rollout.engine import Engine, Request
from services.rl_rollout.publish import encode_group
from services.rl_rollout.sampling import SamplingParams
from services.trainer.rl.rollouts import decode_group
from services.trainer.rl.step import pack, rl_step, routing_replay, token_logprobs
from tests.rl_helpers import tiny_model

TOK = load_tokenizer("byte")
TEMPERATURE = 1.0


def _groups(model, prompts=("12+7=", "3*4="), n=4, seed=0, version=0):
    engine = Engine(model, TOK, max_batch=8, max_seq_len=64, seed=seed)
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=6, stop_at_eos=False)
    out = []
    for g, prompt in enumerate(prompts):
        cs = engine.generate([Request(TOK.encode(prompt), params, tag=i) for i in range(n)])
        rewards = [1.0 if i == 0 else 0.0 for i in range(n)]  # the first sample of each group is "correct"
        msg = encode_group(f"w:{g}", "w", version, "test", prompt, {}, TEMPERATURE, cs, rewards)
        out.append(decode_group(msg.SerializeToString()))
    engine.close()
    return out


def test_trajectory_groups_round_trip_through_the_wire_format():
    model = tiny_model(seed=1)
    group = _groups(model)[0]
    assert group.version == 0 and group.temperature == TEMPERATURE and len(group.samples) == 4
    s = group.samples[0]
    assert s.routing.shape == (len(model.moe_layers()), len(s.prompt_tokens) + len(s.tokens) - 1, model.cfg.top_k)
    assert s.logprobs.shape == (len(s.tokens),) and s.reward == 1.0


def test_replayed_routing_reproduces_the_rollout_logprobs_and_other_routing_does_not():
    model = tiny_model(seed=2)
    groups = _groups(model)
    adv = torch.zeros(len(groups), 4)
    for mb in pack(groups, adv, max_tokens=10_000):
        m = mb.response
        with torch.no_grad():
            replayed = token_logprobs(model, mb, TEMPERATURE)
            torch.testing.assert_close(replayed[m], mb.rollout_logp[m], atol=1e-4, rtol=0)
            wrong = dataclasses.replace(mb, routing=(mb.routing + 1) % model.cfg.num_experts)
            assert (token_logprobs(model, wrong, TEMPERATURE)[m] - mb.rollout_logp[m]).abs().max() > 1e-2
    assert all(layer.router.replay_ids is None for layer in model.moe_layers())  # replay never leaks out


def test_replay_refuses_routing_recorded_for_another_model_shape():
    model = tiny_model(seed=2)
    with pytest.raises(ValueError, match="MoE layers"):
        with routing_replay(model, torch.zeros(5, 3, 2, dtype=torch.int64)):
            pass


def _step(model, groups, lr=0.01, **cfg):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return rl_step(model, opt, groups, RLConfig(**cfg), torch.device("cpu"), version=1)


def test_a_grpo_step_raises_the_likelihood_of_rewarded_samples_and_lowers_the_others():
    model = tiny_model(seed=3)
    groups = _groups(model)
    mbs = pack(groups, torch.zeros(2, 4), max_tokens=10_000)
    with torch.no_grad():
        before = token_logprobs(model, mbs[0], TEMPERATURE)
    metrics = _step(model, groups, micro_batch_tokens=10_000)
    with torch.no_grad():
        after = token_logprobs(model, mbs[0], TEMPERATURE)
    # Per-sample summed log-prob change, in pack order (group-major, sample-minor).
    seg = torch.repeat_interleave(torch.arange(8), (mbs[0].cu_seqlens[1:] - mbs[0].cu_seqlens[:-1]).long())
    m = mbs[0].response
    delta = torch.zeros(8).index_add_(0, seg[m], (after - before)[m]).view(2, 4)
    assert bool((delta[:, 0] > 0).all()) and bool((delta[:, 1:] < 0).all()), delta
    assert metrics["reward"] == pytest.approx(0.25)
    assert metrics["response_length"] == 6 and metrics["staleness_max"] == 1
    assert metrics["logprob_mismatch"] < 1e-4  # same fp32 weights, replayed routing: train and rollout agree
    assert metrics["clip_frac"] == 0.0  # first and only update: pi_theta == pi_old


def test_the_update_does_not_depend_on_how_samples_are_split_into_micro_batches():
    base = tiny_model(seed=4)
    groups = _groups(base)
    one, many = copy.deepcopy(base), copy.deepcopy(base)
    _step(one, groups, micro_batch_tokens=10_000)
    _step(many, groups, micro_batch_tokens=12)  # one sample per micro-batch
    assert len(pack(groups, torch.zeros(2, 4), 12)) == 8
    for (name, a), b in zip(one.named_parameters(), many.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_groups_with_equal_rewards_give_no_policy_gradient():
    model = tiny_model(seed=5)
    groups = _groups(model)
    for g in groups:
        for s in g.samples:
            s.reward = 1.0
    before = copy.deepcopy(model.state_dict())
    metrics = _step(model, groups)
    assert metrics["grad_norm"] == 0.0
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), name
