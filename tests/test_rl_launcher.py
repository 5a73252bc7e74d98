"""An RL run is one command: `foldmoe train --config configs/rl_tiny.yaml` starts Redis, two rollout workers, the
dataloader (packing their trajectory stream), the checkpointer and the RL trainer; streams reward, response length,
clip fraction, KL, log-prob mismatch and staleness per step; lands checkpoints; stops every process; and a second run resumes from the newest checkpoint with weights that
reproduce the rollout log-probs exactly."""

from __future__ import annotations

import json
import os
import re
import sys
import uuid
from pathlib import Path

import pytest
import redis

sys.path.insert(0, str(Path(__file__).parent))
import launcher_harness as harness  # noqa: E402

from services.checkpointer.store import CheckpointStore  # noqa: E402
from services.common import rollout_stream  # noqa: E402

METRICS = ("reward", "response_length", "clip_frac", "kl", "logprob_mismatch", "staleness_max", "rollout_wait_frac")


def rl_train(tmp_path: Path, run: str, steps: int, *extra: str, wait: bool = True):
    overrides = [f"run.name={run}", f"run.steps={steps}", "checkpoint.interval=2", f"run.dir={tmp_path / 'run'}",
                 f"checkpoint.dir={tmp_path / 'ckpt'}", f"run.metrics_file={tmp_path / 'metrics.jsonl'}",
                 "rl.groups_per_step=2", *extra,
                 # An RL run reads no corpus: a missing one must not matter (nor be tokenized).
                 f"data.corpus=[{tmp_path / 'no-corpus'}]", f"data.dataset_dir={tmp_path / 'data'}"]
    cmd = harness.cli("train", "--config", "configs/rl_tiny.yaml", *overrides)
    if not wait:
        return harness.start(cmd, tmp_path)
    return harness.run(cmd, tmp_path, timeout=120)


def records(tmp_path: Path) -> list[dict]:
    path = tmp_path / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def forget_stream(run: str) -> None:
    """With an external Redis (REDIS_URL) the run's stream outlives the run; an embedded Redis goes with it."""
    if os.environ.get("REDIS_URL"):
        stream = f"foldmoe:{run}:rl:trajectories"
        redis.Redis.from_url(os.environ["REDIS_URL"]).delete(stream, rollout_stream.read_position_key(stream),
                                                             rollout_stream.step_key(stream))


def test_one_command_runs_grpo_with_two_workers_checkpoints_and_resumes(tmp_path):
    run = f"rl-launch-{uuid.uuid4().hex[:8]}"
    try:
        first = rl_train(tmp_path, run, steps=4)
        assert first.rc == 0, first.stderr[-3000:]
        assert first.strays == []
        assert "trainer finished; every service stopped cleanly" in first.stderr
        for name in ("rollout0", "rollout1", "dataloader", "checkpointer", "trainer"):
            assert f"started {name} " in first.stderr
        progress = [line for line in first.stdout.splitlines() if line.startswith("step ")]
        assert len(progress) == 4 and all(f" {w} " in progress[0] for w in ("reward", "len", "clip", "kl",
                                                                            "mismatch", "stale"))
        assert re.search(r" wait \d+ms \(\d+% of the step\) ", progress[0]), progress[0]
        logged = records(tmp_path)
        assert [r["step"] for r in logged] == [1, 2, 3, 4]
        for r in logged:
            assert all(r[k] is not None for k in METRICS), r
            assert 0.0 <= r["reward"] <= 1.0 and 1 <= r["response_length"] <= 6
            assert 0 <= r["staleness_max"] <= 1  # rl.max_staleness
            assert 0.0 <= r["rollout_wait_frac"] <= 1.0
            assert r["rollout_wait_frac"] == pytest.approx(r["rollout_wait_s"] / r["step_time_s"])
            assert r["policy_versions"][-1] <= r["step"] - 1  # trained on weights it had published, never later ones
            assert r["samples"] == 2 * 8  # rl.groups_per_step whole groups of rl.group_size
        assert logged[0]["policy_versions"] == [0] and logged[0]["logprob_mismatch"] < 1e-4
        # Both workers pulled weights (a worker logs each version it loads). Which version first depends on when the
        # worker came up: one that starts after the trainer's first step pulls version 1 or later.
        for name in ("rollout0", "rollout1"):
            assert re.search(r"loaded weights version \d+ ", (tmp_path / "run" / "logs" / f"{name}.log").read_text())
        assert CheckpointStore(tmp_path / "ckpt", keep_last=0).steps() == [2, 4]
        assert not (tmp_path / "data").exists()

        second = rl_train(tmp_path, run, steps=5)
        assert second.rc == 0, second.stderr[-3000:]
        assert second.strays == []
        assert "resumed from" in second.stdout + second.stderr
        step5 = records(tmp_path)[-1]
        assert step5["step"] == 5 and step5["policy_versions"] == [4]
        # The restored weights are version 4 exactly: the trainer recomputes the workers' log-probs of them.
        assert step5["logprob_mismatch"] < 1e-4
        assert CheckpointStore(tmp_path / "ckpt", keep_last=0).latest_step() == 5
    finally:
        forget_stream(run)


def test_an_rl_run_with_fewer_groups_per_step_than_data_parallel_replicas_is_refused(tmp_path, capsys):
    from services.cli import main

    code = main(["train", "--config", "configs/rl_tiny.yaml", "run.nproc=2", "rl.groups_per_step=1",
                 f"run.dir={tmp_path / 'run'}", f"data.corpus=[{tmp_path / 'no-such-corpus'}]"])
    assert code == 2
    assert "`rl.groups_per_step=1` is fewer than the 2 data-parallel replicas" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_an_rl_run_on_two_expert_parallel_trainer_ranks_publishes_gathered_weights_the_workers_reproduce(tmp_path):
    run = f"rl-ep2-{uuid.uuid4().hex[:8]}"
    try:
        done = rl_train(tmp_path, run, 3, "run.nproc=2", "parallel.ep=2")
        assert done.rc == 0, done.stderr[-3000:]
        assert done.strays == []
        logged = records(tmp_path)
        assert [r["step"] for r in logged] == [1, 2, 3] and all(r["trainer_ranks"] == 2 for r in logged)
        # The workers generated with the weights rank 0 gathered from both ranks' expert shards: the trainer's
        # log-probs of their samples (same version) agree with the workers' own.
        for r in logged:
            if r["policy_versions"] == [r["step"] - 1]:
                assert r["logprob_mismatch"] < 1e-4, r
        assert logged[0]["policy_versions"] == [0]
        assert CheckpointStore(tmp_path / "ckpt", keep_last=0).steps() == [2, 3]
    finally:
        forget_stream(run)


# dynamic CP: micro-batches of one sample (at most 9 positions here), each of CP size 1, so each runs on one of the two
# CP ranks (tests/test_rl_cp.py mixes the sizes)
DYNAMIC_CP = ("parallel.cp=2", "parallel.cp_sizes=[1,2]", "data.cp_max_tokens_per_rank=9", "rl.micro_batch_tokens=10")


@pytest.mark.parametrize("layout", [("parallel.pp=2",), ("parallel.cp=2",), DYNAMIC_CP])
def test_an_rl_run_on_two_pipeline_stages_or_cp_ranks_with_a_reference_trains_and_publishes_what_workers_reproduce(
        layout, tmp_path):
    run = f"rl-{layout[0][9:11]}2-{uuid.uuid4().hex[:8]}"
    try:
        done = rl_train(tmp_path, run, 3, "run.nproc=2", *layout, "rl.kl_coef=0.01")
        assert done.rc == 0, done.stderr[-3000:]
        assert done.strays == []
        logged = records(tmp_path)
        assert [r["step"] for r in logged] == [1, 2, 3] and all(r["trainer_ranks"] == 2 for r in logged)
        for r in logged:
            # rank 0 logs: the loss sums (computed on the last stage; summed over the CP ranks' cuts) reached it
            assert r["tis_weight"] > 0.5 and r["grad_norm"] > 0 and r["kl"] >= 0, r
            # the workers generated with the weights rank 0 gathered from both ranks: the trainer's log-probs of their
            # samples (same version, each stage replaying its own layer's routing, each CP rank its zigzag cut)
            # agree with the workers' own
            if r["policy_versions"] == [r["step"] - 1]:
                assert r["logprob_mismatch"] < 1e-4, r
        assert logged[0]["policy_versions"] == [0] and logged[0]["kl"] < 1e-6  # the reference is the initial policy
        assert logged[-1]["kl"] > 0
        assert CheckpointStore(tmp_path / "ckpt", keep_last=0).steps() == [2, 3]
    finally:
        forget_stream(run)


def test_rl_mode_starts_rollout_workers_the_dataloader_replicas_and_the_rl_trainer(tmp_path):
    from services.common.config import load_config
    from services.launcher import child_specs

    cfg = load_config("configs/rl_tiny.yaml", ["rl.workers=3"])
    specs = child_specs(tmp_path / "config.yaml", cfg)
    assert [s.name for s in specs] == ["rollout0", "rollout1", "rollout2", "dataloader", "checkpointer", "trainer"]
    assert "services.trainer.rl.train_rl" in specs[-1].argv
    assert specs[3].registers_as == "dataloader" and "services.dataloader.server" in specs[3].argv
    cfg = load_config("configs/rl_tiny.yaml", ["rl.workers=1", "data.replicas=2"])
    assert [s.name for s in child_specs(tmp_path / "config.yaml", cfg)] == ["rollout0", "dataloader0", "dataloader1",
                                                                          "checkpointer", "trainer"]


def test_an_rl_run_on_two_data_parallel_trainer_ranks_trains_checkpoints_and_resumes(tmp_path):
    run = f"rl-dp2-{uuid.uuid4().hex[:8]}"
    try:
        first = rl_train(tmp_path, run, 3, "run.nproc=2")
        assert first.rc == 0, first.stderr[-3000:]
        assert first.strays == []
        progress = [line for line in first.stdout.splitlines() if line.startswith("step ")]
        assert len(progress) == 3  # rank 0 alone prints
        logged = records(tmp_path)
        assert [r["step"] for r in logged] == [1, 2, 3] and all(r["trainer_ranks"] == 2 for r in logged)
        assert all(r["samples"] == 2 * 8 and 0.0 <= r["rollout_wait_frac"] <= 1.0 for r in logged)
        assert logged[0]["policy_versions"] == [0] and logged[0]["logprob_mismatch"] < 1e-4
        assert CheckpointStore(tmp_path / "ckpt", keep_last=0).steps() == [2, 3]

        second = rl_train(tmp_path, run, 4, "run.nproc=2")
        assert second.rc == 0, second.stderr[-3000:]
        assert "resumed from" in second.stdout + second.stderr
        step4 = records(tmp_path)[-1]
        # Both ranks restored version 3 exactly: the workers' log-probs of it are reproduced.
        assert step4["step"] == 4 and step4["policy_versions"] == [3] and step4["logprob_mismatch"] < 1e-4
    finally:
        forget_stream(run)
