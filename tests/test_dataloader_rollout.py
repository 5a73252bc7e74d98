"""RL source: the dataloader builds each optimizer step from the rollout Redis stream.

Specification: a step is `rl.groups_per_step` whole groups fresh enough for it (version within `rl.max_staleness` of
the step, never above it); the others are dropped and counted once, the counters travelling with the position; every
completion token of every sample is an action exactly once, with its rollout log-prob, reward, advantage, version and
routing; prompt positions are never actions; the step's samples are dealt to the dp ranks and packed into micro-batches
of at most `rl.micro_batch_tokens`, each with the CP size the pre-training budget gives it; a step is built only when
a rank asks for it; a position resumes exactly on a new service; entries are trimmed once every rank is past them, and
a position whose entries are gone reads on from the oldest one left. With `rl.prompts` each place is trained on once:
a second answer is dropped, a place whose group came too stale is asked again at once, one missing for
`rl.rollout_timeout_s` then (by one replica), never one the counter has not passed; a starting trainer has the workers
ask its position's missing places first.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter

import numpy as np
import pytest
import redis
import torch

from proto import rollout_pb2
from services.common import rollout_stream
from services.common.config import load_config
from services.dataloader.client import DataClient
from services.dataloader.cp_sizing import (CPBudget, choose_cp_size, deal_by_cost, dp_rank_time, segment_lengths,
                                           work)
from services.dataloader.errors import DataError
from services.dataloader.packing import best_fit_decreasing
from services.dataloader.rollout_source import (RolloutStepStream, TrajectoryLog, build_rl_micro_batch, group_samples,
                                                pack_step)
from services.dataloader.server import DataLoaderServer
from tests.test_dataloader_service import REDIS_URL, registry, same  # noqa: F401

LAYERS, TOP_K = 2, 2  # model.num_layers=2, first_k_dense=0, top_k=2 below


def make_group(rng, gid: str, version: int = 0, samples: int = 4) -> rollout_pb2.TrajectoryGroup:
    prompt = rng.integers(0, 250, size=int(rng.integers(1, 8))).tolist()
    g = rollout_pb2.TrajectoryGroup(group_id=gid, worker="w", policy_version=version, prompt_tokens=prompt,
                                    moe_layers=LAYERS, top_k=TOP_K, temperature=1.0)
    for _ in range(samples):
        n = int(rng.integers(1, 20))
        fed = len(prompt) + n - 1
        g.samples.add(tokens=rng.integers(0, 250, size=n).tolist(), logprobs=(-rng.random(n)).tolist(),
                      routing=rng.integers(0, 8, size=LAYERS * fed * TOP_K).tolist(), reward=float(rng.random()))
    return g


def rl_cfg(key, *extra):
    return load_config(None, ["rl.enabled=true", f"data.rollout_stream={key}", "rl.groups_per_step=4",
                              "rl.group_size=4", "rl.micro_batch_tokens=48", "rl.max_staleness=1", "data.prefetch=1",
                              "model.num_layers=2", "model.top_k=2", "model.first_k_dense=0",
                              f"run.name=test-dl-{uuid.uuid4().hex[:10]}", *extra])


@pytest.fixture
def stream_key():
    key = f"test-dl-rl-{uuid.uuid4().hex[:10]}"
    yield key
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(key, rollout_stream.read_position_key(key), rollout_stream.step_key(key),
                  rollout_stream.prompt_cursor_key(key), rollout_stream.prompt_again_key(key),
                  *client.keys(rollout_stream.prompt_again_key(key) + ":*"))


def publish(key, groups):
    client = redis.Redis.from_url(REDIS_URL)
    return [client.xadd(key, {"group": g.SerializeToString(), "version": g.policy_version}).decode() for g in groups]


def test_completion_tokens_are_the_actions_with_their_logprobs_rewards_versions_and_routing():
    g = rollout_pb2.TrajectoryGroup(group_id="g", policy_version=7, prompt_tokens=[5, 6, 7], moe_layers=1, top_k=1)
    g.samples.add(tokens=[8, 9], logprobs=[-0.5, -0.25], routing=[1, 2, 3, 4], reward=1.0)
    g.samples.add(tokens=[10], logprobs=[-1.0], routing=[5, 6, 7], reward=0.0)
    a, b = group_samples(g, std_normalize=False, layers=1, top_k=1)
    assert (a.advantage, b.advantage) == (0.5, -0.5)  # reward minus the group mean
    mb = build_rl_micro_batch([a, b], layers=1, top_k=1).tensors
    assert mb["tokens"].tolist() == [5, 6, 7, 8, 5, 6, 7]  # no padding
    assert mb["labels"].tolist() == [-100, -100, 8, 9, -100, -100, 10]
    assert mb["loss_mask"].tolist() == [False, False, True, True, False, False, True]
    assert mb["rollout_logprobs"].tolist() == [0, 0, -0.5, -0.25, 0, 0, -1.0]
    assert mb["advantages"].tolist() == [0, 0, 0.5, 0.5, 0, 0, -0.5]
    assert mb["rewards"].tolist() == [0, 0, 1, 1, 0, 0, 0]
    assert mb["versions"].tolist() == [-1, -1, 7, 7, -1, -1, 7]
    assert mb["routing_ids"][:, 0, 0].tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert mb["cu_seqlens"].tolist() == [0, 4, 7]


def test_grpo_advantages_are_group_centred_and_std_normalised():
    g = rollout_pb2.TrajectoryGroup(group_id="g", prompt_tokens=[1], moe_layers=1, top_k=1)
    for reward in (1.0, 0.0, 0.0, 0.0):
        g.samples.add(tokens=[2], logprobs=[-1.0], routing=[0], reward=reward)
    # mean 0.25, Bessel std sqrt((0.75² + 3·0.25²)/3) = 0.5
    assert [s.advantage for s in group_samples(g, True, 1, 1)] == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    assert [s.advantage for s in group_samples(g, False, 1, 1)] == [0.75, -0.25, -0.25, -0.25]
    for s in g.samples:
        s.reward = 1.0
    assert [s.advantage for s in group_samples(g, True, 1, 1)] == [0.0] * 4  # an all-equal group teaches nothing


def test_advantages_are_normalised_within_each_group():
    rng = np.random.default_rng(0)
    samples = group_samples(make_group(rng, "g", samples=6), std_normalize=True, layers=LAYERS, top_k=TOP_K)
    adv = np.array([s.advantage for s in samples])
    assert abs(adv.mean()) < 1e-6 and abs(adv.std(ddof=1) - 1) < 1e-4


def test_routing_recorded_for_another_model_is_refused_with_the_fix():
    g = make_group(np.random.default_rng(1), "g")
    with pytest.raises(DataError, match="run the rollout workers with the trainer's model config"):
        group_samples(g, True, layers=LAYERS + 1, top_k=TOP_K)


def actions(micro_batches):
    """(label, rollout log-prob, advantage, version) of every action in the micro-batches."""
    out = Counter()
    for mb in micro_batches:
        m = mb["loss_mask"]
        out.update(zip(mb["labels"][m].tolist(), [round(x, 5) for x in mb["rollout_logprobs"][m].tolist()],
                       [round(x, 4) for x in mb["advantages"][m].tolist()], mb["versions"][m].tolist()))
    return out


def expected_actions(groups):
    out = Counter()
    for g in groups:
        for s in group_samples(g, True, LAYERS, TOP_K):
            first = max(s.prompt_len - 1, 0)
            for j, label in enumerate(s.tokens[first + 1:].tolist()):
                out[(label, round(float(s.logprobs[first + 1 - s.prompt_len + j]), 5), round(s.advantage, 4),
                     s.version)] += 1
    return out


def test_a_step_is_dealt_to_the_dp_ranks_whole_and_packed_within_the_token_budget():
    rng = np.random.default_rng(5)
    groups = [make_group(rng, f"g{i}") for i in range(4)]
    per_rank = pack_step(groups, dp_size=3, max_tokens=30, std_normalize=True, layers=LAYERS, top_k=TOP_K)
    assert actions(mb.tensors for rank in per_rank for mb in rank) == expected_actions(groups)
    assert all(rank for rank in per_rank)
    for mb in (mb for rank in per_rank for mb in rank):
        assert mb.real_tokens <= 30 or mb.num_segments == 1  # a longer sample gets a micro-batch of its own
    mine = pack_step(groups, 3, 30, True, LAYERS, TOP_K, dp_ranks={1})  # a replica builds only its ranks' share
    assert [len(r) for r in mine] == [0, len(per_rank[1]), 0]
    assert all(same(a.tensors, b.tensors) for a, b in zip(mine[1], per_rank[1], strict=True))


def long_tailed_group(rng, gid: str, version: int = 0, samples: int = 4) -> rollout_pb2.TrajectoryGroup:
    """A group whose completions scatter log-normally around a typical length that is itself log-normal across
    groups: mostly short answers, a few very long ones (as reasoning RL makes)."""
    prompt = rng.integers(0, 250, size=int(rng.integers(2, 9))).tolist()
    g = rollout_pb2.TrajectoryGroup(group_id=gid, worker="w", policy_version=version, prompt_tokens=prompt,
                                    moe_layers=LAYERS, top_k=TOP_K, temperature=1.0)
    typical = 12 * rng.lognormal(0, 0.8)
    for n in np.clip(typical * rng.lognormal(0, 0.6, size=samples), 1, 200).astype(int).tolist():
        fed = len(prompt) + n - 1
        g.samples.add(tokens=rng.integers(0, 250, size=n).tolist(), logprobs=(-rng.random(n)).tolist(),
                      routing=rng.integers(0, 8, size=LAYERS * fed * TOP_K).tolist(), reward=float(rng.random()))
    return g


def rank_time(rank, scale: int, cp: int = 4) -> float:
    return dp_rank_time([(segment_lengths(mb.tensors["cu_seqlens"]), mb.cp_size) for mb in rank], cp, scale)


@pytest.mark.parametrize("seed, dp", [(2, 2), (2, 4), (8, 4)])
def test_a_long_tailed_step_is_served_the_plan_whose_slowest_rank_finishes_first(seed, dp):
    """Of the two plans (the step's micro-batches, each sized, dealt by work costliest first to the least-loaded
    rank as the corpus stream deals them, which LPT bounds by the mean plus (1 - 1/dp) of the (dp+1)-th costliest
    micro-batch, or by the costliest; the samples dealt by positions and each rank's share packed), the one served
    has the faster slowest rank, a rank's time as its 4 CP ranks run its micro-batches (cp_sizing.dp_rank_time: each
    on the block cp_share gives it). Seed 8 at dp=4 is where the summed work misleads: the sample dealing's heaviest
    rank has less work (153.7 token-equivalents against 156.1) but its small-CP micro-batches split unevenly over the
    blocks, and its slowest rank takes 54.9 against 42.0."""
    rng = np.random.default_rng(seed)
    groups = [long_tailed_group(rng, f"g{i}") for i in range(8)]
    max_tokens, cp_sizes, budget = 64, [1, 2, 4], CPBudget(max_tokens_per_rank=32, max_attn_per_rank=32 * 64)
    per_rank = pack_step(groups, dp, max_tokens, True, LAYERS, TOP_K, cp_sizes=cp_sizes, budget=budget, cp=4)
    assert all(per_rank) and actions(mb.tensors for rank in per_rank for mb in rank) == expected_actions(groups)
    served = max(rank_time(rank, max_tokens) for rank in per_rank)

    samples = [s for g in groups for s in group_samples(g, True, LAYERS, TOP_K)]

    def sized(bins):
        return [(b, choose_cp_size([s.positions for s in b], cp_sizes, budget)) for b in bins]

    def slowest(plan):
        return max(dp_rank_time([([s.positions for s in b], c) for b, c in rank], 4, max_tokens) for rank in plan)

    def heaviest(plan):
        return max(sum(work([s.positions for s in b], max_tokens) for b, _ in rank) for rank in plan)
    whole = sized(best_fit_decreasing(samples, max_tokens))
    assert {c for _, c in whole} >= {1, 2}  # small sizes occur: the blocks split them
    costs = [work([s.positions for s in b], max_tokens) for b, _ in whole]
    by_micro_batch = [[whole[i] for i in rank] for rank in deal_by_cost(costs, dp)]
    by_sample = [sized(best_fit_decreasing([samples[i] for i in share], max_tokens))
                 for share in deal_by_cost([s.positions for s in samples], dp)]
    ranked = sorted(costs, reverse=True)
    assert heaviest(by_micro_batch) <= max(ranked[0], sum(costs) / dp + (1 - 1 / dp) * ranked[dp]) + 1e-9
    assert served == pytest.approx(min(slowest(by_micro_batch), slowest(by_sample)))
    if (seed, dp) == (8, 4):
        assert heaviest(by_sample) < heaviest(by_micro_batch) and served < 0.8 * slowest(by_sample)


def test_a_group_dealt_over_several_ranks_keeps_the_advantages_of_the_whole_group():
    """GRPO normalises a reward within its group; the source does it before dealing, so the samples of a group that
    land on different dp ranks still carry the whole group's advantages (the trainer's loss is a sum over the step
    divided by the step's response tokens, services/trainer/rl/step.py: it needs nothing else of the group)."""
    rng = np.random.default_rng(3)
    groups = [long_tailed_group(rng, f"g{i}", version=i, samples=6) for i in range(4)]  # the version names the group
    per_rank = pack_step(groups, 4, 64, True, LAYERS, TOP_K)
    served: dict[int, list[tuple[int, float]]] = {}  # group -> (rank, advantage) per sample
    for r, rank in enumerate(per_rank):
        for mb in rank:
            cu = mb.tensors["cu_seqlens"].tolist()
            for a, b in zip(cu, cu[1:]):
                m = mb.tensors["loss_mask"][a:b]
                adv, version = mb.tensors["advantages"][a:b][m], mb.tensors["versions"][a:b][m]
                assert len(set(adv.tolist())) == 1 and len(set(version.tolist())) == 1  # one sample, one group
                served.setdefault(int(version[0]), []).append((r, float(adv[0])))
    assert any(len({r for r, _ in got}) > 1 for got in served.values())  # some group is split over ranks
    for got in served.values():
        adv = np.array([a for _, a in got])
        assert len(adv) == 6 and abs(adv.mean()) < 1e-5 and abs(adv.std(ddof=1) - 1) < 1e-3


def test_only_groups_fresh_enough_for_the_step_are_used_and_the_others_are_counted_once(stream_key):
    rng = np.random.default_rng(6)
    cfg = rl_cfg(stream_key, "rl.groups_per_step=2")
    # step 0 accepts versions 0 (and none newer); step 1 accepts 0..1; step 2 accepts 1..2
    versions = [0, 1, 0, 0, 3, 1, 0, 2, 1]
    groups = [make_group(rng, f"g{i}", version=v) for i, v in enumerate(versions)]
    publish(stream_key, groups)
    stream = RolloutStepStream(TrajectoryLog(REDIS_URL, stream_key), cfg, 1)
    taken, states = [], []
    for _ in range(3):
        step = stream.next_step()
        taken.append(sorted({v for mb in step.per_rank[0] for v in mb.tensors["versions"].tolist() if v >= 0}))
        states.append(step.state_after["stream"])
    # step 0: g0 (v0), g1 (v1: foreign), g2 (v0) -> [g0, g2]; step 1: g3 (v0), g4 (v3: foreign), g5 (v1);
    # step 2: g6 (v0: stale), g7 (v2), g8 (v1)
    assert taken == [[0], [0, 1], [1, 2]]
    assert [(s["dropped_stale"], s["dropped_foreign"]) for s in states] == [(0, 1), (0, 2), (1, 2)]
    # a replay from a saved position counts nothing twice: the counters are part of the position
    again = RolloutStepStream(TrajectoryLog(REDIS_URL, stream_key), cfg, 1)
    again.reset({**stream.state(), "step": 1, "stream": states[0]})
    again.next_step()
    again.next_step()
    assert again.state()["stream"] == states[2]
    with pytest.raises(DataError, match="fewer than 2 trajectory groups fresh enough for step 3"):
        again.next_step()


def again(key: str) -> list[int]:
    return [int(p) for p in redis.Redis.from_url(REDIS_URL).lrange(rollout_stream.prompt_again_key(key), 0, -1)]


def test_the_position_keeps_the_prompt_places_and_a_starting_trainer_has_the_workers_ask_the_missing_first(stream_key):
    from services.common.registry import Registry
    from services.trainer.rl.train_rl import data_position, discard_backlog

    rng = np.random.default_rng(7)
    cfg = rl_cfg(stream_key, "rl.groups_per_step=2")
    # rl.prompts groups of 8 records an epoch, finished out of order (places 2 and 4 still out after step 1); g2 is a
    # dead incarnation's (foreign at step 1): its place is left to the counter, which asks it anew
    groups = [make_group(rng, f"g{i}", version=v) for i, v in enumerate([0, 0, 3, 1, 1])]
    for g, seq in zip(groups, [2, 1, 9, 4, 6]):
        g.prompt_seq, g.prompt_records = seq, 8
    publish(stream_key, groups)
    stream = RolloutStepStream(TrajectoryLog(REDIS_URL, stream_key), cfg, 1)
    first = stream.next_step().state_after["stream"]
    assert (first["prompts_next"], first["prompts_missing"], first["prompt_records"]) == (2, [], 8)
    assert data_position({"stream": first})["prompt_epochs"] == 0.25
    stream.reset({**stream.state(), "step": 1, "stream": first})  # a resume goes on from the position
    second = stream.next_step().state_after["stream"]
    assert second["dropped_foreign"] == 1 and (second["prompts_next"], second["prompts_missing"]) == (6, [2, 4])
    assert data_position({"stream": second})["prompt_epochs"] == 4 / 8  # places 0, 1, 3, 5 trained on
    assert "prompt_epochs" not in data_position({"stream": {"after": "0-0"}})  # a built-in task's run: no epochs

    run = f"test-dl-{uuid.uuid4().hex[:10]}"
    registry = Registry(REDIS_URL, run)
    beat = registry.register("rollout", {"stream": stream_key, "worker": "w"}, instance="w")
    try:
        registry.client.set(rollout_stream.prompt_cursor_key(stream_key), 40)  # a previous incarnation's asks
        assert discard_backlog(registry, 5.0, second) == 5
        assert int(registry.client.get(rollout_stream.prompt_cursor_key(stream_key))) == 6
        assert again(stream_key) == [2, 4]  # every place the position misses, before the counter's
    finally:
        beat.stop()
        registry.client.delete(rollout_stream.prompt_cursor_key(stream_key))


def test_each_prompt_place_is_trained_on_once_and_a_dropped_or_lost_one_is_asked_again(stream_key):
    rng = np.random.default_rng(3)
    cfg = rl_cfg(stream_key, "rl.groups_per_step=2", "rl.max_staleness=1", "rl.rollout_timeout_s=0.3")
    stream = RolloutStepStream(TrajectoryLog(REDIS_URL, stream_key), cfg, 1)
    client = redis.Redis.from_url(REDIS_URL)
    client.set(rollout_stream.prompt_cursor_key(stream_key), 9)  # the workers have claimed places 0-8

    def step(*groups: tuple[str, int, int]) -> tuple[list[str], dict]:
        """Publish (id, version, prompt_seq) groups, build the next step: its group ids and the position after it."""
        made = [make_group(rng, gid, version=v) for gid, v, _ in groups]
        for g, (_, _, seq) in zip(made, groups):
            g.prompt_seq, g.prompt_records = seq, 100
        publish(stream_key, made)
        taken = next(stream.node)
        return [g.group_id for g in taken], stream.node.get_state()

    ids, st = step(("a", 0, 2), ("b", 0, 4))  # places 1 and 3; 0 and 2 are out
    assert (st["prompts_next"], st["prompts_missing"]) == (4, [0, 2])
    # c answers place 0; d is place 3 again (asked again while b was out, say): a duplicate, dropped; e is new
    ids, st = step(("c", 0, 1), ("d", 1, 4), ("e", 1, 5))
    assert ids == ["c", "e"] and st["dropped_duplicate"] == 1
    assert (st["prompts_next"], st["prompts_missing"]) == (5, [2])
    # place 2's group comes too late (version 0 at step 2 with staleness 1) and is dropped, but h of the same step
    # answers it: trained on, not asked again
    ids, st = step(("f", 0, 3), ("g", 2, 6), ("h", 2, 3))
    assert ids == ["g", "h"] and st["dropped_stale"] == 1 and again(stream_key) == []
    assert (st["prompts_next"], st["prompts_missing"]) == (6, [])
    # place 6's group comes too late too (version 1 at step 3): dropped and asked again at once
    ids, st = step(("k", 1, 7), ("i", 3, 8), ("j", 3, 9))
    assert ids == ["i", "j"] and st["dropped_stale"] == 2 and again(stream_key) == [6]
    assert st["prompts_missing"] == [6]
    # and while it stays missing (its new group lost with a worker), again after rl.rollout_timeout_s, by one of the
    # replicas
    other = RolloutStepStream(TrajectoryLog(REDIS_URL, stream_key), cfg, 1)  # a second replica at the same position
    other.reset(stream.state())
    stream.ready(), other.ready()
    time.sleep(0.4)
    assert not stream.ready() and not other.ready()  # no group to build step 4 from; place 6 missing too long
    assert again(stream_key) == [6, 6]  # once, though both replicas found it missing
    time.sleep(0.4)
    stream.ready()
    assert again(stream_key) == [6, 6, 6]  # and again while it stays missing
    # a place the counter has not passed (set back by a resume) is left to it, however missing
    client.set(rollout_stream.prompt_cursor_key(stream_key), 5)
    time.sleep(0.4)
    stream.ready()
    assert again(stream_key) == [6, 6, 6]
    client.set(rollout_stream.prompt_cursor_key(stream_key), 9)
    # the position survives a restart: the same ledger from the saved state
    again_stream = RolloutStepStream(TrajectoryLog(REDIS_URL, stream_key), cfg, 1)
    again_stream.reset(stream.state())
    assert again_stream.node.get_state() == stream.node.get_state()
    # a group of place 6 comes after all (a slow worker's, not lost): trained on, and no worker is left to ask it
    ids, st = step(("l", 3, 7), ("m", 3, 10))
    assert ids == ["l", "m"] and st["prompts_missing"] == [] and again(stream_key) == []


def test_the_workers_room_leaves_out_groups_too_stale_for_the_steps_that_would_read_them(stream_key):
    """Otherwise a backlog of stale groups, which the dataloader will only drop, would stop the workers while the
    dataloader waits for fresh groups: the run would stall (seen in an RL chaos run)."""
    rng = np.random.default_rng(7)
    cfg = rl_cfg(stream_key, "rl.groups_per_step=1", "rl.max_staleness=1")
    client = redis.Redis.from_url(REDIS_URL)
    publish(stream_key, [make_group(rng, "g0", version=0)])
    stream = RolloutStepStream(TrajectoryLog(REDIS_URL, stream_key), cfg, 1)
    stream.next_step()  # step 0 consumed g0; the next step is 1
    assert int(client.get(rollout_stream.step_key(stream_key))) == 1
    publish(stream_key, [make_group(rng, f"s{i}", version=0) for i in range(3)])  # usable by step 1 (v >= 0)
    assert rollout_stream.unread_versions(client, stream_key, 100, 1) == ([0, 0, 0], 1)
    # a worker with version 1: step 1 reads one of them, step 2 drops the other two (too stale): room for one group
    assert rollout_stream.room([0, 0, 0], 1, 1, 1, 1) == 1
    stream.next_step()  # step 1 takes s0; s1, s2 are too stale for step 2 and later
    publish(stream_key, [make_group(rng, "f0", version=2), make_group(rng, "f1", version=1)])
    waiting, next_step = rollout_stream.unread_versions(client, stream_key, 100, 1)
    assert (waiting, next_step) == ([0, 0, 2, 1], 2)  # everything after the read position
    # read up to the first group step 2 could use: the stale ones before it come along
    assert rollout_stream.unread_versions(client, stream_key, 1, 1) == ([0, 0, 2], 2)
    # groups of version 2: step 2 drops s1, s2 and reads f0; step 3 drops f1 (too stale for it) and has room for one
    assert rollout_stream.room(waiting, next_step, 2, 1, 1) == 1
    stream.next_step()  # step 2 drops s1, s2 and takes f0
    assert stream.state()["stream"]["dropped_stale"] == 2


def test_service_builds_each_step_only_when_asked_serves_every_action_once_and_trims(stream_key, registry):
    rng = np.random.default_rng(2)
    cfg = rl_cfg(stream_key)
    server = DataLoaderServer(cfg, registry).start()
    redis_client = redis.Redis.from_url(REDIS_URL)
    try:
        c = DataClient.from_registry(registry, 0, 1, cfg, rank=0, world_size=1, timeout=20)
        assert c.on_demand
        c.timeout = 3
        groups = [make_group(rng, f"g{i}", version=i // 4) for i in range(32)]  # the versions of steps 0..7
        publish(stream_key, groups[:2])  # fewer than rl.groups_per_step=4: nothing to serve yet
        with pytest.raises(DataError, match="no micro-batch .* within 3s"):
            c.next_step()
        c.close()
        publish(stream_key, groups[2:])
        c = DataClient.from_registry(registry, 0, 1, cfg, rank=0, world_size=1, timeout=20)
        got = c.next_step()
        time.sleep(0.5)
        assert server.engine.stream.step == 1  # nothing was built ahead of the trainer's request
        assert len(rollout_stream.unread_versions(redis_client, stream_key, 100, 1)[0]) == len(groups) - 4  # backlog
        for _ in range(6):
            got += c.next_step()
        assert all(mb["routing_ids"].shape[1:] == (LAYERS, TOP_K) and mb["loss_mask"].dtype == torch.bool
                   and (mb["tokens"].numel() <= 48 or len(mb["cu_seqlens"]) == 2) for mb in got)
        assert actions(got) == expected_actions(groups[:28])  # 7 steps of 4 groups: each action once
        assert redis_client.xlen(stream_key) < len(groups)  # entries every rank passed were trimmed
        c.close()
    finally:
        server.stop()


def test_rl_stream_resumed_on_a_new_service_equals_the_uninterrupted_one(stream_key, registry):
    rng = np.random.default_rng(3)
    publish(stream_key, [make_group(rng, f"g{i}", version=i // 8) for i in range(24)])
    cfg = rl_cfg(stream_key, "rl.max_staleness=2")
    reference = RolloutStepStream(TrajectoryLog(REDIS_URL, stream_key), cfg, 1)
    reference = [[mb.tensors for mb in reference.next_step().per_rank[0]] for _ in range(5)]  # reads, trims nothing
    server = DataLoaderServer(cfg, registry).start()
    c = DataClient.from_registry(registry, 0, 1, cfg, rank=0, world_size=1, timeout=20)
    got = [c.next_step(), c.next_step()]
    saved = c.state()
    c.close()
    server.stop()
    server = DataLoaderServer(cfg, registry).start()
    try:
        c = DataClient.from_registry(registry, 0, 1, cfg, rank=0, world_size=1, timeout=20)
        assert c.resume(saved) == 2
        got += [c.next_step() for _ in range(3)]
        for mine, ref in zip(got, reference, strict=True):
            assert all(same({k: v for k, v in a.items() if k != "cp_size"}, b) for a, b in zip(mine, ref, strict=True))
        c.close()
    finally:
        server.stop()


def test_a_position_whose_trajectories_were_trimmed_reads_on_from_the_oldest_entry_left(stream_key):
    rng = np.random.default_rng(4)
    groups = [make_group(rng, f"g{i}") for i in range(16)]
    ids = publish(stream_key, groups)
    cfg = rl_cfg(stream_key)
    log = TrajectoryLog(REDIS_URL, stream_key)
    stream = RolloutStepStream(log, cfg, 1)
    stream.next_step()
    saved = stream.state()
    log.trim_through(ids[9])  # a later incarnation trained on entries 4..9 and trimmed them before it died
    stream.reset(saved)
    step = stream.next_step()
    assert actions(mb.tensors for mb in step.per_rank[0]) == expected_actions(groups[10:14])


def test_each_micro_batch_gets_the_smallest_cp_size_under_the_budget_and_static_cp_its_one_size(stream_key):
    """As the corpus stream sizes them (cp_sizing.choose_cp_size): tokens per CP rank <= data.cp_max_tokens_per_rank
    and Σ l² per CP rank <= data.cp_max_attn_per_rank, else the largest size. Under static CP (one size) every
    micro-batch of the same step carries `parallel.cp`: the trainer cuts it over the whole group. (Which micro-batches
    the step is packed into, and which rank gets which, may differ: the dealing weighs each by its size.)"""
    rng = np.random.default_rng(8)
    tokens, attn = 24, 300  # per CP rank: the samples here are 2-24 tokens, micro-batches 24-48
    cfg = rl_cfg(stream_key, f"data.cp_max_tokens_per_rank={tokens}", f"data.cp_max_attn_per_rank={attn}")
    publish(stream_key, [make_group(rng, f"g{i}") for i in range(8)])
    dynamic = RolloutStepStream(TrajectoryLog(REDIS_URL, stream_key), cfg, 2, cp_sizes=[1, 2, 4])
    static = RolloutStepStream(TrajectoryLog(REDIS_URL, stream_key), cfg, 2, cp_sizes=[2])
    sizes, by_attention = Counter(), 0
    for _ in range(2):
        step, same_step = dynamic.next_step(), static.next_step()
        assert all(mb.cp_size == 2 for r in same_step.per_rank for mb in r)
        assert actions(mb.tensors for r in same_step.per_rank for mb in r) == \
            actions(mb.tensors for r in step.per_rank for mb in r)
        for mb in (m for r in step.per_rank for m in r):
            cu = mb.tensors["cu_seqlens"].tolist()
            lengths = [b - a for a, b in zip(cu, cu[1:])]
            fits = [c for c in (1, 2, 4) if sum(lengths) <= tokens * c and sum(n * n for n in lengths) <= attn * c]
            assert mb.cp_size == (fits[0] if fits else 4), (lengths, mb.cp_size)
            sizes[mb.cp_size] += 1
            by_attention += sum(lengths) <= tokens * mb.cp_size // 2  # its tokens alone would fit a smaller size
    assert set(sizes) == {1, 2, 4} and by_attention, (sizes, by_attention)  # every size occurs, both limits decide
