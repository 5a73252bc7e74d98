"""docs/config.md is generated from the config dataclasses and is current: every field of every section is listed with
its type, default and the comment written beside it in services/common/config.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

from services.common.config import Config
from services.common.config_doc import field_comments, render

ROOT = Path(__file__).resolve().parent.parent


def test_committed_reference_is_what_the_generator_prints():
    res = subprocess.run([sys.executable, "-m", "services.common.config_doc"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    committed = (ROOT / "docs" / "config.md").read_text()
    assert res.stdout == committed, ("docs/config.md is stale: regenerate it with "
                                     "`python -m services.common.config_doc > docs/config.md`")


def test_every_field_of_every_section_has_a_row():
    rows = {line.split("|")[1].strip().strip("`") for line in render().splitlines() if line.startswith("| `")}
    expected = {f"{section.name}.{f.name}" for section in dataclasses.fields(Config)
                for f in dataclasses.fields(typing.get_type_hints(Config)[section.name])}
    assert rows == expected


def test_row_shows_type_default_and_comment():
    lines = render().splitlines()
    assert "| `run.max_restarts` | int | `3` | times the launcher restarts each crashed service" in "\n".join(lines)
    assert any(line.startswith("| `model.score_func` | `softmax` \\| `sigmoid` | `\"softmax\"` |") for line in lines)


@dataclass
class _Example:
    plain: int = 1
    commented: int = 2  # own comment
    #                     continued below
    followed: int = 3  # has its own
    # introduces the next field
    introduced: list[int] = field(default_factory=list)
    last: str = "x"  # end


def test_comments_are_attributed_to_the_field_they_describe():
    assert field_comments(_Example) == {
        "plain": "",
        "commented": "own comment continued below",
        "followed": "has its own",
        "introduced": "introduces the next field",
        "last": "end",
    }
