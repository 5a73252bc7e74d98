"""`foldmoe train` refuses a run it cannot start with ONE line naming the cause and the fix and a non-zero exit code,
before or while starting processes, and leaves no process behind."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import launcher_harness as harness  # noqa: E402


def train(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None) -> harness.Result:
    base = [f"run.dir={tmp_path / 'run'}", f"data.dataset_dir={tmp_path / 'data'}",
            f"checkpoint.dir={tmp_path / 'ckpt'}", f"run.metrics_file={tmp_path / 'metrics.jsonl'}"]
    return harness.run(harness.cli("train", "--config", "configs/tiny.yaml", *base, *overrides), tmp_path, env=env)


def assert_one_error_line(res: harness.Result, *fragments: str) -> None:
    assert res.rc != 0
    assert len(res.error_lines) == 1, res.stderr
    line = res.error_lines[0]
    assert line.startswith("foldmoe: error: "), line
    for fragment in fragments:
        assert fragment in line, line
    assert res.strays == []


def test_unknown_config_key_is_one_line_naming_the_key(tmp_path):
    res = train(tmp_path, "model.hidden_sise=64")
    assert_one_error_line(res, "unknown config key `model.hidden_sise`")


def test_impossible_config_value_is_one_line_naming_the_key(tmp_path):
    res = train(tmp_path, "model.top_k=9")
    assert_one_error_line(res, "`model.top_k=9`", "`model.num_experts=8`")


def test_missing_config_file_is_one_line(tmp_path):
    res = harness.run(harness.cli("train", "--config", str(tmp_path / "nope.yaml")), tmp_path)
    assert_one_error_line(res, "nope.yaml", "does not exist")


def test_trainer_world_that_does_not_fit_the_parallel_layout_is_refused_before_starting(tmp_path):
    res = train(tmp_path, "run.nproc=3", "parallel.ep=2")
    assert_one_error_line(res, "world size 3")
    assert not (tmp_path / "run" / "logs").exists()


def test_missing_corpus_is_one_line_naming_the_path(tmp_path):
    res = train(tmp_path, f"data.corpus=[{tmp_path / 'no-such-corpus'}]")
    assert_one_error_line(res, "no-such-corpus", "data.corpus")
    assert not (tmp_path / "run" / "logs").exists()  # nothing was started


@pytest.mark.parametrize("how", ["config", "env"])
def test_unreachable_redis_is_one_line_naming_the_url_and_where_it_came_from(tmp_path, how):
    url = "redis://127.0.0.1:1"
    if how == "config":
        res = train(tmp_path, f"run.redis_url={url}")
        assert_one_error_line(res, url, "run.redis_url")
    else:
        res = train(tmp_path, env={"REDIS_URL": url})
        assert_one_error_line(res, url, "REDIS_URL")


def test_malformed_redis_url_is_one_line(tmp_path):
    res = train(tmp_path, "run.redis_url=localhost:6379")
    assert_one_error_line(res, "localhost:6379", "redis://")


def test_status_without_a_running_launcher_or_redis_says_how_to_get_one(tmp_path):
    res = harness.run(harness.cli("status", f"run.dir={tmp_path}"), tmp_path, env={"REDIS_URL": ""})
    assert_one_error_line(res, "no running launcher", "foldmoe train")


def test_no_command_prints_usage_and_fails(tmp_path):
    res = harness.run(harness.cli(), tmp_path)
    assert res.rc == 2 and "usage: foldmoe" in res.stderr


def test_preprocess_delegates_to_the_dataloader_with_its_options(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"paragraph {i} " * 20 for i in range(10)))
    args = ["preprocess", "--force", f"data.corpus=[{corpus}]", f"data.dataset_dir={tmp_path / 'data'}"]
    res = harness.run(harness.cli(*args), tmp_path)
    assert res.rc == 0, res.stderr
    assert str(tmp_path / "data") in res.stdout and "documents" in res.stdout
    res = harness.run(harness.cli("preprocess", f"data.corpus=[{tmp_path / 'missing'}]"), tmp_path)
    assert res.rc != 0 and len(res.error_lines) == 1 and "missing" in res.error_lines[0]
