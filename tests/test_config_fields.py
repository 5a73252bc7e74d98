"""Every config field earns its place: something outside the config module reads it, and the comment beside it in
services/common/config.py (which docs/config.md is generated from) says what it does."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from services.common.config import Config, ConfigError, load_config
from services.common.config_doc import field_comments

ROOT = Path(__file__).resolve().parent.parent
FIELDS = [(section.name, cls, f.name) for section in dataclasses.fields(Config)
          for cls in [typing.get_type_hints(Config)[section.name]] for f in dataclasses.fields(cls)]


def _code_outside_the_config_module() -> str:
    files = [p for folder in ("services", "kernels") for p in (ROOT / folder).rglob("*.py")
             if p.name not in ("config.py", "config_doc.py")]
    return "\n".join(p.read_text() for p in files)


def test_every_field_is_read_outside_the_config_module():
    code = _code_outside_the_config_module()
    unread = [f"{section}.{name}" for section, _, name in FIELDS if not re.search(rf"\.{name}\b", code)]
    assert unread == [], f"config fields nothing reads (delete them, or use them): {unread}"


def test_every_field_has_a_comment_saying_what_it_does():
    undocumented = [f"{section}.{name}" for section, cls, name in FIELDS if not field_comments(cls)[name]]
    assert undocumented == [], f"give these fields a comment in services/common/config.py: {undocumented}"


def test_the_unused_run_log_interval_is_gone():
    with pytest.raises(ConfigError, match="unknown config key `run.log_interval`"):
        load_config(None, ["run.log_interval=1"])
