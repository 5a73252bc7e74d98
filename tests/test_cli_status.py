"""`foldmoe status` reads the run-state keys the services write: the trainer's "step" and the checkpointer's
"checkpoint/latest" (services/checkpointer/writer.py publishes it at every commit), and no key nothing writes."""

from __future__ import annotations

import pytest

from services import cli
from services.common import registry as registry_module
from services.common.config import load_config


def fake_registry(state: dict, asked: list[str]):
    class FakeRegistry:
        def __init__(self, url, run):
            pass

        def services(self):
            return []

        def get_state(self, key):
            asked.append(key)
            return state.get(key)

    return FakeRegistry


@pytest.mark.parametrize("state, shown", [
    ({"step": 12, "checkpoint/latest": {"step": 10, "path": "/c/step_00000010"}},
     'latest checkpoint: {"step": 10, "path": "/c/step_00000010"}'),
    ({"step": 3}, "latest checkpoint: -"),  # nothing committed yet
])
def test_status_shows_the_checkpoint_the_writer_published_and_reads_no_other_key(state, shown, monkeypatch, capsys,
                                                                                 tmp_path):
    asked: list[str] = []
    monkeypatch.setattr(registry_module, "Registry", fake_registry(state, asked))
    cfg = load_config(None, ["run.redis_url=redis://fake:1", f"run.metrics_file={tmp_path / 'none.jsonl'}"])
    assert cli.status(cfg) == 0
    assert shown in capsys.readouterr().out.splitlines()
    assert sorted(asked) == ["checkpoint/latest", "step"]
