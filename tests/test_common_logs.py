"""Every service logs one way (services/common/logs.py): each line names the service, and under torchrun the rank;
FOLDMOE_LOG_LEVEL sets the level, and a value that is not a level is reported instead of stopping the service."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ("from services.common import logs; logs.configure('dataloader'); "
          "logs.logger('dataloader').debug('detail'); logs.logger('dataloader').info('serving')")


def run(**env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "FOLDMOE_LOG_LEVEL")}
    res = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env={**base, **env}, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stderr


def test_lines_name_the_service_and_info_is_the_default_level():
    out = run()
    assert " dataloader INFO serving" in out and "detail" not in out


def test_a_torchrun_rank_is_named_on_each_line():
    assert " dataloader rank 3 INFO serving" in run(RANK="3")


def test_the_level_comes_from_the_environment():
    out = run(FOLDMOE_LOG_LEVEL="debug")
    assert "DEBUG detail" in out and "INFO serving" in out
    assert "serving" not in run(FOLDMOE_LOG_LEVEL="WARNING")


def test_a_value_that_is_not_a_level_is_reported_and_info_used():
    out = run(FOLDMOE_LOG_LEVEL="verbose")
    assert "FOLDMOE_LOG_LEVEL=verbose is not a log level (DEBUG, INFO, WARNING, ERROR); using INFO" in out
    assert "INFO serving" in out
