"""RL end to end on CPU: a real rollout worker process, an in-process dataloader service and trainer doing GRPO steps.

The trainer publishes weights version 0, the worker pulls them, generates arithmetic groups and streams them; the
dataloader packs each step's groups and the trainer pulls them through its client, steps, and re-publishes (version 1,
2, ...). The worker must pick the new versions up, every trained sample must carry the version that generated it within
the staleness bound, and the worker must exit cleanly on SIGTERM.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid

import pytest
import redis
import torch
import yaml

from services.common.config import load_config
from services.common.registry import Registry
from services.dataloader.client import DataClient
from services.dataloader.server import DataLoaderServer
from services.rl_rollout.publish import stream_key
from services.trainer.model.transformer import MoETransformer
from services.trainer.rl.step import rl_step
from services.trainer.rl.weight_publisher import WeightPublisher

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
STEPS = 4


# The model's capacity: dropless, or each expert keeping ceil(T·k/E) slots of the trainer's micro-batch, padded to it
# (the worker generates dropless either way: services/rl_rollout/worker.py `rollout_model_config`)
CAPACITY = {"dropless": {}, "capacity": dict(capacity_factor=1.0, pad_to_capacity=True)}


@pytest.fixture(params=list(CAPACITY))
def run_config(tmp_path, request):
    run = f"rl-e2e-{uuid.uuid4().hex[:8]}"
    values = {
        "model": dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=4, top_k=2,
                      moe_ffn_hidden_size=32, ffn_hidden_size=64, **CAPACITY[request.param]),
        "run": dict(name=run, device="cpu", seed=11),
        "rl": dict(enabled=True, task="arithmetic", difficulty=1, group_size=4, prompts_per_batch=2, max_new_tokens=4,
                   max_batch=8, max_seq_len=32, max_staleness=1, max_queued_groups=2, groups_per_step=2,
                   weight_dtype="fp32"),
    }
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(values))
    yield path, load_config(path)
    redis.Redis.from_url(REDIS_URL).delete(stream_key(run))


def test_worker_and_trainer_run_grpo_steps_with_versioned_weights(run_config):
    path, cfg = run_config
    registry = Registry(REDIS_URL, cfg.run.name)
    model = MoETransformer(cfg.model)
    model.init_weights(cfg.run.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    publisher = WeightPublisher.from_config(cfg.rl).start()
    publisher.publish(0, model.state_dict())
    beat = registry.register("rl_weights", {"zmq": publisher.endpoint})
    env = {**os.environ, "REDIS_URL": REDIS_URL, "PYTHONUNBUFFERED": "1"}
    worker = subprocess.Popen([sys.executable, "-m", "services.rl_rollout.worker", "--config", str(path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    dataloader = DataLoaderServer(cfg, registry).start()
    try:
        registry.wait_for("rollout", 1, timeout=60)
        (record,) = registry.lookup("rollout")
        assert record["stream"] == stream_key(cfg.run.name)
        data = DataClient.from_registry(registry, 0, 1, cfg, rank=0, world_size=1, timeout=60)
        seen_versions, history = [], []
        for version in range(STEPS):
            micro_batches = data.next_step()
            for mb in micro_batches:
                trained = mb["versions"][mb["loss_mask"]]
                assert bool((version - cfg.rl.max_staleness <= trained).all() and (trained <= version).all())
            metrics = rl_step(model, optimizer, micro_batches, cfg.rl, torch.device("cpu"), version=version).read()
            # only whole groups ever reach the stream, and the dataloader takes rl.groups_per_step of them
            assert metrics["samples"] == cfg.rl.groups_per_step * cfg.rl.group_size
            history.append(metrics)
            seen_versions += metrics["policy_versions"]
            publisher.publish(version + 1, model.state_dict())
        data.close()
        # The worker followed the trainer: later groups come from re-published weights, not only from version 0.
        assert max(seen_versions) >= STEPS - 1 - cfg.rl.max_staleness
        assert seen_versions == sorted(seen_versions)
        for m in history:
            assert 0.0 <= m["reward"] <= 1.0 and 1 <= m["response_length"] <= cfg.rl.max_new_tokens
            assert m["staleness_max"] <= cfg.rl.max_staleness
        # Fresh groups (step 0 has only version-0 groups) on fp32 weights with routing replay: the trainer recomputes the
        # rollout's log-probs; later steps also see the policy change of stale groups. With a capacity the trainer
        # drops slots the dropless rollout kept, and the mismatch reports it.
        if cfg.model.capacity_factor > 0:
            assert history[0]["logprob_mismatch"] > 1e-4, history[0]
        else:
            assert history[0]["logprob_mismatch"] < 1e-4
        worker.send_signal(signal.SIGTERM)
        out, _ = worker.communicate(timeout=60)
        assert worker.returncode == 0, out
        loaded = [int(v) for v in re.findall(r"loaded weights version (\d+)", out)]
        assert loaded[0] == 0 and len(loaded) > 1 and loaded == sorted(loaded), out
        assert registry.lookup("rollout") == []  # deregistered on the way out
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        beat.stop()
        publisher.stop()
        dataloader.stop()
