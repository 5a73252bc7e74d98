"""`checkpoint.init_from`: a run with nothing to resume starts from another run's model weights (fresh optimizer, step 0).

The source is a real foldmoe checkpoint: configs/rl_tiny.yaml's model pre-trained with the launcher on every one-digit
problem of the RL `arithmetic` task, written in the rollout's exact text format ("7+5=12\n"), i.e. the starting point of
an RL run. Processes run with OMP_NUM_THREADS=1: on a 2-core machine torch's default thread pools spin against each other.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import launcher_harness as harness  # noqa: E402

PRETRAIN_STEPS = 200
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

PRETRAIN = ["rl.enabled=false", "data.seq_len=64", "data.micro_batch_size=8", "optimizer.lr=3e-3",
            "optimizer.min_lr=3e-4", "optimizer.warmup_steps=10", "checkpoint.interval=0"]


def write_corpus(path: Path) -> None:
    """Every one-digit problem of the arithmetic task, one document each, in the rollout's exact text format."""
    from services.rl_rollout.rewards import arithmetic_prompt, arithmetic_reward

    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    lines = []
    for a in range(10):
        for b in range(10):
            for op, fn in ops.items():
                prompt, answer = f"{a}{op}{b}=", fn(a, b)
                assert arithmetic_reward(prompt, f"{answer}\n", {"answer": answer}) == 1.0
                lines.append(json.dumps({"text": f"{prompt}{answer}\n"}))
    # the task's own prompt generator produces exactly these prompts
    import random
    prompt, _ = arithmetic_prompt(random.Random(0), 1)
    assert any(json.loads(line)["text"].startswith(prompt) for line in lines)
    path.write_text("\n".join(lines) + "\n")


def launch(tmp: Path, name: str, *overrides: str, timeout: float):
    cmd = harness.cli("train", "--config", "configs/rl_tiny.yaml", f"run.name={name}-{uuid.uuid4().hex[:8]}",
                      f"run.dir={tmp / name / 'run'}", f"checkpoint.dir={tmp / name / 'ckpt'}",
                      f"run.metrics_file={tmp / name / 'metrics.jsonl'}", f"data.dataset_dir={tmp / name / 'data'}",
                      *overrides)
    result = harness.run(cmd, tmp, env=ENV, timeout=timeout)
    assert result.rc == 0, result.stderr[-3000:]
    assert result.strays == []
    return [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """configs/rl_tiny.yaml's model pre-trained by foldmoe on the task format; returns its checkpoint.dir."""
    tmp = tmp_path_factory.mktemp("pretrain")
    corpus = tmp / "arithmetic.jsonl"
    write_corpus(corpus)
    pre = launch(tmp, "pretrain", *PRETRAIN, f"run.steps={PRETRAIN_STEPS}", f"data.corpus=[{corpus}]", timeout=240)
    assert pre[-1]["loss"] < pre[0]["loss"] - 2, (pre[0]["loss"], pre[-1]["loss"])
    return tmp / "pretrain" / "ckpt"


def test_init_from_loads_weights_only_and_names_what_does_not_fit(pretrained, tmp_path):
    from services.checkpointer.load import find_latest_valid, load_checkpoint
    from services.common.config import load_config
    from services.trainer import checkpointing
    from services.trainer.model.transformer import MoETransformer

    def init(spec, *overrides):
        cfg = load_config("configs/rl_tiny.yaml", [f"checkpoint.init_from={spec}",
                                                   f"checkpoint.dir={tmp_path / 'ckpt'}", *overrides])
        model = MoETransformer(cfg.model)
        model.init_weights(0)
        return checkpointing.init_from(cfg, model), model

    step_dir = find_latest_valid(pretrained)
    path, model = init(pretrained)  # a checkpoint root: its newest valid checkpoint
    assert path == step_dir
    assert init(step_dir)[0] == step_dir  # a step directory itself
    saved = load_checkpoint(step_dir)
    for name, t in model.state_dict().items():
        assert torch.equal(t, saved.read(f"model/{name}")), name
    with pytest.raises(checkpointing.CheckpointLoadError, match="no such file or directory"):
        init(tmp_path / "missing")
    with pytest.raises(checkpointing.CheckpointLoadError, match="holds no committed checkpoint"):
        init(tmp_path)
    with pytest.raises(checkpointing.CheckpointLoadError,
                       match=r"parameter 'embed.weight' is \[264, 64\] .* but \[264, 32\] in this model.*"
                             r"model.hidden_size=64 there, 32 here"):
        init(pretrained, "model.hidden_size=32")
    with pytest.raises(checkpointing.CheckpointLoadError, match=r"has no 'layers.2.*model.num_layers=2 there, 3 here"):
        init(pretrained, "model.num_layers=3")

