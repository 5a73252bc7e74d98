"""`checkpoint.init_from`: a run with nothing to resume starts from another run's model weights (fresh optimizer, step 0).

The source is a real foldmoe checkpoint: configs/rl_tiny.yaml's model pre-trained with the launcher on every one-digit
problem of the RL `arithmetic` task (tests/rl_pretrained.py), i.e. the starting point of an RL run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import rl_pretrained  # noqa: E402


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """configs/rl_tiny.yaml's model pre-trained by foldmoe on the task format; returns its checkpoint.dir."""
    return rl_pretrained.pretrain(tmp_path_factory.mktemp("pretrain"))


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
                       match=r"holds another model than this one: 'embed.weight' is \[264, 64\] there but "
                             r"\[264, 32\] in this model.*model.hidden_size=64 there, 32 here"):
        init(pretrained, "model.hidden_size=32")
    with pytest.raises(checkpointing.CheckpointLoadError, match=r"has no 'layers.2.*model.num_layers=2 there, 3 here"):
        init(pretrained, "model.num_layers=3")

