"""A trainer rank that cannot go on says why in one line and exits non-zero, never with a bare traceback: 2 for what
the user must fix before starting again (config, registry, checkpoint), 1 for a run that started and then lost a
service or a save (the launcher never restarts the trainer, so either code ends the run). The pre-training and RL
trainers behave alike; both log the INFO records of the modules they use (as the services do); a rank whose GPU does
not exist is refused naming `run.nproc`; the RL checks count the ranks that really run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from redis import RedisError

from services.checkpointer.handoff import SaveError
from services.common.config import ConfigError, load_config
from services.common.registry import RegistryError
from services.dataloader.errors import DataError
from services.trainer import checkpointing, train
from services.trainer.rl import train_rl

ROOT = Path(__file__).resolve().parent.parent
ENTRY_POINTS = [(train, "train"), (train_rl, "train_rl")]


@pytest.mark.parametrize("error, code", [
    (ConfigError("`x` is wrong"), 2),
    (RegistryError("cannot reach Redis at redis://h:1"), 2),
    (checkpointing.CheckpointLoadError("checkpoint step_00000010 does not match this model"), 2),
    (DataError("the dataloader at 127.0.0.1:5555 stopped answering"), 1),
    (SaveError("rank 0: no answer from the checkpoint writer"), 1),
    (TimeoutError("no trajectories within 300s"), 1),
    (RedisError("Connection reset by peer"), 1),
], ids=lambda v: type(v).__name__ if isinstance(v, Exception) else str(v))
@pytest.mark.parametrize("module, loop", ENTRY_POINTS, ids=[name for _, name in ENTRY_POINTS])
def test_a_failing_rank_prints_one_line_naming_the_cause_and_exits_non_zero(module, loop, error, code, monkeypatch,
                                                                           capsys):
    def fail(cfg):
        raise error

    monkeypatch.setattr(module, loop, fail)
    assert module.main([]) == code
    err = capsys.readouterr().err
    assert err == f"trainer: error: {error}\n"


SCRIPT = """
import logging, sys
from services.trainer import train as entry
from services.trainer.rl import train_rl
module, loop = (train_rl, "train_rl") if sys.argv[1] == "train_rl" else (entry, "train")
def fake(cfg):
    logging.getLogger("foldmoe.checkpointer").info("rank 0: 1 snapshot buffer(s) of 0.01 GB ready")
    logging.getLogger("foldmoe.checkpointer").debug("a debug record")
    return 0
setattr(module, loop, fake)
sys.exit(module.main([]))
"""


@pytest.mark.parametrize("loop", ["train", "train_rl"])
def test_the_trainer_shows_info_records_of_the_modules_it_uses(loop):
    res = subprocess.run([sys.executable, "-c", SCRIPT, loop], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "trainer INFO rank 0: 1 snapshot buffer(s) of 0.01 GB ready" in res.stderr
    assert "a debug record" not in res.stderr


def test_a_rank_without_a_gpu_of_its_own_is_refused_naming_run_nproc(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail("set_device on a missing GPU"))
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "2")
    cfg = load_config(None, ["run.device=cuda", "run.nproc=3"])
    with pytest.raises(ConfigError, match=r"rank 2 .*GPU 2.* 2 CUDA device.*`run.nproc=3`"):
        train.init_runtime(cfg)


def test_a_rank_with_its_gpu_selects_it(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rt = train.init_runtime(load_config(None, ["run.device=cuda"]))
    assert chosen == [torch.device("cuda", 1)] and rt.device == torch.device("cuda", 1)


def test_the_cpu_path_does_not_ask_for_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: pytest.fail("a CPU run asked for the GPU count"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert train.init_runtime(load_config(None, ["run.device=cpu"])).device == torch.device("cpu")


def test_rl_checks_count_the_ranks_that_run_not_run_nproc():
    cfg = load_config(None, ["rl.enabled=true", "rl.groups_per_step=2", "run.nproc=1"])
    train_rl.validate_rl(cfg)  # as `foldmoe train` starts it: one rank
    with pytest.raises(ConfigError, match="`rl.groups_per_step=2` is fewer than the 4 data-parallel replicas"):
        train_rl.validate_rl(cfg, world_size=4)


def test_the_rl_trainer_validates_against_the_world_size_torchrun_gives_it(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")  # run.nproc stays 1: e.g. compose or a hand-written torchrun
    monkeypatch.setattr(train_rl, "init_runtime", lambda cfg: pytest.fail("validate_rl let the run start"))
    assert train_rl.main(["rl.enabled=true", "rl.groups_per_step=2"]) == 2
    assert "fewer than the 4 data-parallel replicas" in capsys.readouterr().err
