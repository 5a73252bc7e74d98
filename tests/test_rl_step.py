"""The RL step on the dataloader's micro-batches: routing replay makes the trainer evaluate the network that generated
the trajectories, a GRPO step moves probability towards rewarded samples independently of micro-batching, and samples
outside the staleness bound are refused."""

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
from services.trainer.rl.step import RLMicroBatch, rl_step, routing_replay, token_logprobs
from tests.rl_helpers import micro_batches, tiny_model

TOK = load_tokenizer("byte")
TEMPERATURE = 1.0


def _groups(model, prompts=("12+7=", "3*4="), n=4, seed=0, version=0):
    engine = Engine(model, TOK, max_batch=8, max_seq_len=64, seed=seed)
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=6, stop_at_eos=False)
    out = []
    for g, prompt in enumerate(prompts):
        cs = engine.generate([Request(TOK.encode(prompt), params, tag=i) for i in range(n)])
        rewards = [1.0 if i == 0 else 0.0 for i in range(n)]  # the first sample of each group is "correct"
        out.append(encode_group(f"w:{g}", "w", version, "test", prompt, {}, TEMPERATURE, cs, rewards))
    engine.close()
    return out


def _one_micro_batch(groups) -> RLMicroBatch:
    (mb,), = micro_batches(groups, max_tokens=10_000)
    return RLMicroBatch.from_data(mb)


def test_a_micro_batch_carries_every_completion_token_with_its_routing_reward_and_version():
    model = tiny_model(seed=1)
    groups = _groups(model, version=3)
    mb = _one_micro_batch(groups)
    assert mb.routing.shape == (len(model.moe_layers()), len(mb.tokens), model.cfg.top_k)
    assert int(mb.response.sum()) == sum(len(s.tokens) for g in groups for s in g.samples) == 2 * 4 * 6
    assert set(mb.versions[mb.response].tolist()) == {3} and set(mb.versions[~mb.response].tolist()) == {-1}
    assert float(mb.rewards[mb.response].sum()) == 2 * 6  # one rewarded sample of 6 tokens per group


def test_replayed_routing_reproduces_the_rollout_logprobs_and_other_routing_does_not():
    model = tiny_model(seed=2)
    mb = _one_micro_batch(_groups(model))
    m = mb.response
    with torch.no_grad():
        replayed = token_logprobs(model, mb, TEMPERATURE)
        torch.testing.assert_close(replayed[m], mb.rollout_logp[m], atol=1e-4, rtol=0)
        wrong = dataclasses.replace(mb, routing=(mb.routing + 1) % model.cfg.num_experts)
        assert (token_logprobs(model, wrong, TEMPERATURE)[m] - mb.rollout_logp[m]).abs().max() > 1e-2
    assert all(layer.router.replay_ids is None for layer in model.moe_layers())  # replay never leaks out


def test_the_policy_forward_gives_the_attention_the_longest_sample_from_the_host():
    """The attention kernels take the longest document as a host number; without one they read it from the device's
    cu_seqlens, a host sync in every layer on a GPU. A micro-batch takes it from the dataloader's host cu_seqlens and
    keeps it through `to(device)`."""
    from services.trainer.rl.folded import policy_input

    model = tiny_model(seed=1)
    mb = _one_micro_batch(_groups(model))
    longest = int((mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).max())
    assert mb.max_seqlen == longest and mb.to(torch.device("cpu")).max_seqlen == longest
    seen = []
    for block in model.layers.values():
        block.attn.register_forward_pre_hook(lambda _, args: seen.append(args[3]))
    with torch.no_grad():
        token_logprobs(model, mb, TEMPERATURE)
    assert seen == [longest] * len(model.layers)
    assert policy_input(model, mb).max_seqlen == longest  # the folded forward's input; unpadded without TP


def test_replay_refuses_routing_recorded_for_another_model_shape():
    model = tiny_model(seed=2)
    with pytest.raises(ValueError, match="MoE layers"):
        with routing_replay(model, torch.zeros(5, 3, 2, dtype=torch.int64)):
            pass


def _step(model, groups, lr=0.01, version=1, **cfg):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    rl = RLConfig(**cfg)
    (data,) = micro_batches(groups, max_tokens=rl.micro_batch_tokens)
    return rl_step(model, opt, data, rl, torch.device("cpu"), version=version).read()


def test_a_grpo_step_raises_the_likelihood_of_rewarded_samples_and_lowers_the_others():
    model = tiny_model(seed=3)
    groups = _groups(model)
    mb = _one_micro_batch(groups)
    with torch.no_grad():
        before = token_logprobs(model, mb, TEMPERATURE)
    metrics = _step(model, groups, micro_batch_tokens=10_000)
    with torch.no_grad():
        after = token_logprobs(model, mb, TEMPERATURE)
    # Per-sample summed log-prob change, and each sample's reward
    lengths = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).long()
    seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    m = mb.response
    delta = torch.zeros(len(lengths)).index_add_(0, seg[m], (after - before)[m])
    rewarded = torch.zeros(len(lengths)).index_add_(0, seg[m], mb.rewards[m]) > 0
    assert int(rewarded.sum()) == 2
    assert bool((delta[rewarded] > 0).all()) and bool((delta[~rewarded] < 0).all()), delta
    assert metrics["reward"] == pytest.approx(0.25) and metrics["samples"] == 8
    assert metrics["response_length"] == 6 and metrics["staleness_max"] == 1 and metrics["policy_versions"] == [0]
    assert metrics["logprob_mismatch"] < 1e-4  # same fp32 weights, replayed routing: train and rollout agree
    assert metrics["clip_frac"] == 0.0  # first and only update: pi_theta == pi_old


def test_a_dense_model_trains_on_its_groups_which_record_no_routing():
    """RL of a dense model (every MLP dense: an imported Qwen3 or Llama before upcycling): its groups record no
    routing, which the dataloader takes whatever the config's top_k, and a GRPO step moves it as it moves an MoE."""
    from services.dataloader.errors import DataError
    from services.dataloader.rollout_source import group_samples

    model = tiny_model(seed=3, first_k_dense=3)
    groups = _groups(model)
    assert (groups[0].moe_layers, groups[0].top_k) == (0, 0) and not model.moe_layers()
    assert len(group_samples(groups[0], True, layers=0, top_k=model.cfg.top_k)) == 4
    with pytest.raises(DataError, match="records routing for 0 MoE layers x top-0 but the model has 2 x top-2"):
        group_samples(groups[0], True, layers=2, top_k=2)
    mb = _one_micro_batch(groups)
    with torch.no_grad():
        before = token_logprobs(model, mb, TEMPERATURE)
    _step(model, groups, micro_batch_tokens=10_000)
    with torch.no_grad():
        after = token_logprobs(model, mb, TEMPERATURE)
    m = mb.response
    assert float((after - before)[m & (mb.rewards > 0)].sum()) > 0 > float((after - before)[m & (mb.rewards == 0)].sum())


def test_the_update_does_not_depend_on_how_samples_are_split_into_micro_batches():
    base = tiny_model(seed=4)
    groups = _groups(base)
    one, many = copy.deepcopy(base), copy.deepcopy(base)
    _step(one, groups, micro_batch_tokens=10_000)
    _step(many, groups, micro_batch_tokens=12)  # one sample per micro-batch
    assert len(micro_batches(groups, max_tokens=12)[0]) == 8
    for (name, a), b in zip(one.named_parameters(), many.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_recompute_and_offload_leave_the_rl_update_unchanged():
    """The memory policies RL allows (validate_rl refuses "moe" and "layer": their recompute would route afresh)."""
    from services.trainer.model.recompute import apply_memory_policy

    base = tiny_model(seed=6)
    groups = _groups(base)
    plain, lean = copy.deepcopy(base), copy.deepcopy(base)
    apply_memory_policy(lean, ["norm", "attn_core", "moe_act"], ["attn"])
    want, got = _step(plain, groups), _step(lean, groups)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == (v if isinstance(v, list) else pytest.approx(v, rel=1e-6, abs=1e-9)), k
    for (name, a), b in zip(plain.named_parameters(), lean.parameters()):
        torch.testing.assert_close(b, a, atol=1e-7, rtol=1e-6, msg=name)


@pytest.mark.parametrize("recompute", [["moe"], ["layer"]])
def test_an_rl_run_refuses_recompute_that_would_rerun_the_router(recompute):
    from services.common.config import Config, ConfigError
    from services.trainer.rl.train_rl import validate_rl

    cfg = Config()
    cfg.rl.enabled, cfg.model.recompute = True, recompute
    with pytest.raises(ConfigError, match="outside routing replay"):
        validate_rl(cfg)


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


def test_samples_outside_the_staleness_bound_are_refused_not_trained_on():
    model = tiny_model(seed=6)
    before = copy.deepcopy(model.state_dict())
    for generated, trainer in ((0, 3), (2, 1)):  # too stale for max_staleness=1; newer than the trainer
        with pytest.raises(ValueError, match="disagree on the step"):
            _step(model, _groups(model, version=generated), version=trainer, max_staleness=1)
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), name
