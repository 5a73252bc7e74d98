"""RL source: the dataloader packs trajectory groups from the rollout Redis stream into micro-batches.

Specification: every completion token of every sample is an action exactly once, with its rollout log-prob, its
sample's reward and GRPO advantage and its recorded routing; prompt and padding positions are never actions; the
service waits for enough groups instead of serving short steps; a position resumes exactly on a new service; entries
are trimmed from the stream once every rank is past them.
"""

from __future__ import annotations

import uuid
from collections import Counter

import numpy as np
import pytest
import redis
import torch

from proto import rollout_pb2
from services.common.config import load_config
from services.dataloader.client import DataClient
from services.dataloader.errors import DataError
from services.dataloader.rollout_source import (RolloutStepStream, TrajectoryLog, build_rl_micro_batch,
                                                group_samples)
from services.dataloader.server import DataLoaderServer
from services.common.tokenizer import load_tokenizer
from tests.test_dataloader_service import REDIS_URL, registry, same  # noqa: F401

LAYERS, TOP_K = 2, 2  # model.num_layers=2, first_k_dense=0, top_k=2 below


def make_group(rng, gid: str, samples: int = 4) -> rollout_pb2.TrajectoryGroup:
    prompt = rng.integers(0, 250, size=int(rng.integers(1, 8))).tolist()
    g = rollout_pb2.TrajectoryGroup(group_id=gid, worker="w", policy_version=3, prompt_tokens=prompt,
                                    moe_layers=LAYERS, top_k=TOP_K)
    for _ in range(samples):
        n = int(rng.integers(1, 20))
        fed = len(prompt) + n - 1
        g.samples.add(tokens=rng.integers(0, 250, size=n).tolist(), logprobs=(-rng.random(n)).tolist(),
                      routing=rng.integers(0, 8, size=LAYERS * fed * TOP_K).tolist(), reward=float(rng.random()))
    return g


def rl_cfg(key, *extra):
    return load_config(None, ["data.source=rollout", f"data.rollout_stream={key}", "data.seq_len=32",
                              "data.micro_batch_size=2", "data.grad_accum=2", "data.prefetch=2",
                              "data.packing_window=16", "rl.group_size=4", "model.num_layers=2", "model.top_k=2",
                              "model.first_k_dense=0", f"run.name=test-dl-{uuid.uuid4().hex[:10]}", *extra])


@pytest.fixture
def stream_key():
    key = f"test-dl-rl-{uuid.uuid4().hex[:10]}"
    yield key
    redis.Redis.from_url(REDIS_URL).delete(key)


def publish(key, groups):
    client = redis.Redis.from_url(REDIS_URL)
    return [client.xadd(key, {"group": g.SerializeToString(), "version": g.policy_version}).decode() for g in groups]


def test_completion_tokens_are_the_actions_with_their_logprobs_rewards_and_routing():
    g = rollout_pb2.TrajectoryGroup(group_id="g", prompt_tokens=[5, 6, 7], moe_layers=1, top_k=1)
    g.samples.add(tokens=[8, 9], logprobs=[-0.5, -0.25], routing=[1, 2, 3, 4], reward=1.0)
    g.samples.add(tokens=[10], logprobs=[-1.0], routing=[5, 6, 7], reward=0.0)
    a, b = group_samples(g, std_normalize=False, layers=1, top_k=1)
    assert (a.advantage, b.advantage) == (0.5, -0.5)  # reward minus the group mean
    mb = build_rl_micro_batch([[a, b]], 8, pad_id=0, layers=1, top_k=1).tensors
    assert mb["tokens"].tolist() == [5, 6, 7, 8, 5, 6, 7, 0]
    assert mb["labels"].tolist() == [-100, -100, 8, 9, -100, -100, 10, -100]
    assert mb["loss_mask"].tolist() == [False, False, True, True, False, False, True, False]
    assert mb["rollout_logprobs"].tolist() == [0, 0, -0.5, -0.25, 0, 0, -1.0, 0]
    assert mb["advantages"].tolist() == [0, 0, 0.5, 0.5, 0, 0, -0.5, 0]
    assert mb["rewards"].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert mb["routing_ids"][:, 0, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, -1]
    assert mb["cu_seqlens"].tolist() == [0, 4, 7, 8]


def test_advantages_are_normalised_within_each_group():
    rng = np.random.default_rng(0)
    samples = group_samples(make_group(rng, "g", samples=6), std_normalize=True, layers=LAYERS, top_k=TOP_K)
    adv = np.array([s.advantage for s in samples])
    assert abs(adv.mean()) < 1e-6 and abs(adv.std(ddof=1) - 1) < 1e-4


def test_routing_recorded_for_another_model_is_refused_with_the_fix():
    g = make_group(np.random.default_rng(1), "g")
    with pytest.raises(DataError, match="run the rollout workers with the trainer's model config"):
        group_samples(g, True, layers=LAYERS + 1, top_k=TOP_K)


def actions(steps):
    """(rollout log-prob, advantage) of every action in the micro-batches, with its label."""
    out = []
    for mb in steps:
        m = mb["loss_mask"]
        out += zip(mb["labels"][m].tolist(), mb["rollout_logprobs"][m].tolist(), mb["advantages"][m].tolist())
    return sorted(out)


def test_service_packs_the_stream_serves_every_action_once_and_trims_what_all_ranks_passed(stream_key, registry):
    rng = np.random.default_rng(2)
    groups = [make_group(rng, f"g{i}") for i in range(48)]
    cfg = rl_cfg(stream_key)
    server = DataLoaderServer(cfg, registry).start()
    try:
        c = DataClient.from_registry(registry, 0, 1, cfg, rank=0, world_size=1, timeout=20)
        c.timeout = 3
        publish(stream_key, groups[:2])  # less than one window of 16 // 4 = 4 groups: nothing to serve yet
        with pytest.raises(DataError, match="no micro-batch .* within 3s"):
            c.next_step()
        c.close()
        publish(stream_key, groups[2:])
        c = DataClient.from_registry(registry, 0, 1, cfg, rank=0, world_size=1, timeout=20)
        got = [mb for _ in range(6) for mb in c.next_step()]
        assert all(mb["routing_ids"].shape == (64, LAYERS, TOP_K) and mb["loss_mask"].dtype == torch.bool
                   for mb in got)
        position = server.engine.stream.sequences.get_state()
        # every action served is an action of a published sample, none served twice
        expected = Counter()
        for g in groups:
            for s in group_samples(g, True, LAYERS, TOP_K):
                first = max(s.prompt_len - 1, 0)
                for j, label in enumerate(s.tokens[first + 1:].tolist()):
                    expected[(label, round(float(s.logprobs[first + 1 - s.prompt_len + j]), 5), round(s.advantage, 4))] += 1
        seen = Counter((label, round(lp, 5), round(adv, 4)) for label, lp, adv in actions(got))
        assert sum(seen.values()) > 100 and not seen - expected
        length = redis.Redis.from_url(REDIS_URL).xlen(stream_key)
        assert length < len(groups) and position["after"] != "0-0"  # entries every rank passed were trimmed
        c.close()
    finally:
        server.stop()


def test_rl_stream_resumed_on_a_new_service_equals_the_uninterrupted_one(stream_key, registry):
    rng = np.random.default_rng(3)
    publish(stream_key, [make_group(rng, f"g{i}") for i in range(64)])
    cfg = rl_cfg(stream_key)
    pad_id = load_tokenizer(cfg.data.tokenizer).pad_id  # what the service pads with
    reference = RolloutStepStream(TrajectoryLog(REDIS_URL, stream_key), cfg, 1, None, pad_id)
    reference = [[mb.tensors for mb in reference.next_step().per_rank[0]] for _ in range(5)]  # reads, trims nothing
    server = DataLoaderServer(cfg, registry).start()
    c = DataClient.from_registry(registry, 0, 1, cfg, rank=0, world_size=1, timeout=20)
    got = [c.next_step(), c.next_step()]
    saved = c.state()
    c.close()
    server.stop()  # the service goes away with prefetched micro-batches unread
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


def test_a_position_whose_trajectories_were_trimmed_is_refused_with_the_cause(stream_key):
    rng = np.random.default_rng(4)
    ids = publish(stream_key, [make_group(rng, f"g{i}") for i in range(16)])
    cfg = rl_cfg(stream_key)
    log = TrajectoryLog(REDIS_URL, stream_key)
    stream = RolloutStepStream(log, cfg, 1, None, pad_id=0)
    stream.next_step()
    saved = stream.state()
    log.trim_through(ids[8])
    with pytest.raises(DataError, match="no longer holds entry .* trimmed"):
        stream.reset(saved)
        stream.next_step()
