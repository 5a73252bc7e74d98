"""The README's two set-up commands are the ones the repository supports: `run.sh` knows them, and CI runs the
README's test command exactly."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    section = ROOT.joinpath("README.md").read_text().split("## Two commands", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_gives_exactly_a_train_and_a_test_command():
    assert readme_commands() == ["bash run.sh train", "bash run.sh test"]


def test_ci_runs_the_readme_test_command_exactly():
    ci = ROOT / ".ci" / "run"
    assert os.access(ci, os.X_OK)
    lines = [line.strip() for line in ci.read_text().splitlines()]
    commands = [line for line in lines if line and not line.startswith("#")]
    assert commands[-1] == readme_commands()[1]


def test_run_sh_refuses_an_unknown_command_with_its_usage():
    res = subprocess.run(["bash", str(ROOT / "run.sh"), "deploy"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2
    assert "usage: bash run.sh {train|test|setup}" in res.stderr


def test_scripts_are_valid_bash():
    for script in (ROOT / "run.sh", ROOT / ".ci" / "run"):
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0, script
