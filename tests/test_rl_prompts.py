"""Prompts and rewards of an RL run: a built-in task's generator, or JSONL records of the user's own.

Specification: `rl.prompts` records become (prompt, meta) pairs, meta being every other field; shuffled once by
run.seed, the first `rl.eval_prompts` are the evaluation's when `rl.eval_interval` is set and no training draw ever
returns one; each worker's draws are a function of its seed; `rl.reward` names a registered reward or a
`module:function`; the built-in `number` and `exact` rewards compare the completion with the record's answer, which is
checked for every record when read; a built-in task without `rl.prompts` gives the prompts it gave before; a rollout
worker trains and evaluates on the records; bad input (unreadable file, a line that is not JSON or has no prompt, an
answer the reward cannot compare, too few records, an unknown reward or task, an unimportable function) is refused
naming the file and line or the key, by `foldmoe train` before any process starts.
"""

from __future__ import annotations

import json
import os
import random
import sys
import uuid

import pytest

from services import cli
from services.common.config import ConfigError, RLConfig
from services.rl_rollout.prompts import load_reward, rl_prompts
from services.rl_rollout.rewards import arithmetic_prompt, exact_reward, number_reward

RECORDS = [{"prompt": f"What is {i} squared? Answer:", "answer": str(i * i), "id": i} for i in range(20)]


def write(tmp_path, records, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_records_split_into_evaluation_and_training_prompts(tmp_path):
    rl = RLConfig(prompts=[write(tmp_path, RECORDS)], reward="number", eval_interval=5, eval_prompts=4)
    run = rl_prompts(rl, seed=7)
    assert len(run.eval) == 4 and run.eval == rl_prompts(rl, seed=7).eval != rl_prompts(rl, seed=8).eval
    assert all(meta == {"answer": str(r["id"] ** 2), "id": r["id"]} for (prompt, meta), r in
               ((e, RECORDS[e[1]["id"]]) for e in run.eval))
    held = {p for p, _ in run.eval}
    def draws(worker: str) -> list:
        rng = random.Random(worker)
        return [run.task.make_prompt(rng, 2) for _ in range(200)]

    drawn = draws("worker0") + draws("worker1")
    assert held.isdisjoint(p for p, _ in drawn)
    assert {p for p, _ in drawn} == {r["prompt"] for r in RECORDS} - held  # every other record is drawn
    assert draws("worker0") == drawn[:200] != drawn[200:]  # a worker's draws follow its seed
    assert run.task.reward is number_reward and run.task.name == "prompts.jsonl"
    no_eval = rl_prompts(RLConfig(prompts=rl.prompts, reward="number"), seed=7)
    rng = random.Random(0)
    assert no_eval.eval == [] and {no_eval.task.make_prompt(rng, 2)[0] for _ in range(400)} == \
        {r["prompt"] for r in RECORDS}  # without evaluations every record trains


@pytest.mark.parametrize("reward, answer, completion, score", [
    (number_reward, "1,234", "so the answer is 1234.", 1.0), (number_reward, 0.1, "#### 0.1", 1.0),
    (number_reward, 7, "Answer: 8", 0.0), (exact_reward, "Paris", "  Paris\n", 1.0),
    (exact_reward, "Paris", "paris", 0.0),
])
def test_the_answer_rewards(reward, answer, completion, score):
    assert reward("q", completion, {"answer": answer}) == score


def test_a_reward_by_module_and_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def length(prompt, completion, meta):\n    return float(len(completion))\n"
                                            "NOT_CALLABLE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward("my_rewards:length")("p", "abc", {}) == 3.0
    rl = RLConfig(prompts=[write(tmp_path, [{"prompt": "free-form"}])], reward="my_rewards:length")
    assert rl_prompts(rl, seed=0).task.reward("p", "ab", {}) == 2.0  # no answer needed by this reward
    for spec, names in (("my_rewards:nope", "has no 'nope'"), ("my_rewards:NOT_CALLABLE", "not a function"),
                        ("no_such_module_xyz:f", "cannot import no_such_module_xyz"), ("nope", "no registered reward")):
        with pytest.raises(ConfigError, match=names):
            load_reward(spec)


def test_a_builtin_task_gives_the_prompts_it_gave_before(tmp_path):
    rl = RLConfig(task="arithmetic", eval_interval=2, eval_prompts=5)
    evaluation_rng = random.Random("3:evaluation")
    assert rl_prompts(rl, seed=3).eval == [arithmetic_prompt(evaluation_rng, rl.difficulty) for _ in range(5)]
    assert rl_prompts(RLConfig(task="arithmetic", reward="exact"), seed=3).task.reward is exact_reward
    with pytest.raises(ConfigError, match="unknown task 'nope'"):
        rl_prompts(RLConfig(task="nope"), seed=3)


@pytest.mark.parametrize("lines, reward, names", [
    (['{"prompt": "a", "answer": 1}', "{not json"], "number", r"prompts.jsonl:2 is not valid JSON"),
    (['{"question": "a"}'], "number", r"prompts.jsonl:1 has no non-empty string \"prompt\""),
    (['{"prompt": "a"}'], "number", r"prompts.jsonl:1 has no \"answer\" the reward can compare with \(got 'none'\)"),
    (['{"prompt": "a", "answer": "seven"}'], "number", r"prompts.jsonl:1 has no \"answer\".*'seven'"),
    ([""], "number", r"hold\(s\) no records"),
])
def test_bad_records_are_refused_naming_file_and_line(tmp_path, lines, reward, names):
    with pytest.raises(ConfigError, match=names):
        rl_prompts(RLConfig(prompts=[write(tmp_path, lines)], reward=reward), seed=0)


def test_exact_reads_any_answer_and_the_evaluation_must_leave_records_to_train_on(tmp_path):
    rl = RLConfig(prompts=[write(tmp_path, ['{"prompt": "a", "answer": [1]}'] * 3)], reward="exact")
    assert len(rl_prompts(rl, seed=0).eval) == 0  # exact compares text: any answer has one
    with pytest.raises(ConfigError, match="holds 3 records.*rl.eval_prompts=3"):
        rl_prompts(RLConfig(prompts=rl.prompts, reward="exact", eval_interval=1, eval_prompts=3), seed=0)


def test_foldmoe_train_refuses_a_bad_prompts_file_before_starting_anything(tmp_path, capsys):
    missing = tmp_path / "missing.jsonl"
    code = cli.main(["train", "--config", "configs/rl_tiny.yaml", f"rl.prompts=[{missing}]", "rl.reward=number",
                     f"run.dir={tmp_path / 'run'}"])
    assert code == 2 and f"cannot read {missing}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # no process was started, no run directory made


def test_a_rollout_worker_trains_and_evaluates_on_the_records(tmp_path):
    from services.common.registry import Registry
    from services.common.config import load_config
    from services.rl_rollout.worker import RolloutWorker
    from test_rl_worker_ops import REDIS_URL, TINY

    path = write(tmp_path, RECORDS)
    run = f"rl-prompts-{uuid.uuid4().hex[:8]}"
    cfg = load_config("configs/rl_tiny.yaml", [f"run.name={run}", *TINY, f"rl.prompts=[{path}]", "rl.reward=number",
                                               "rl.eval_interval=2", "rl.eval_prompts=3"])
    worker = RolloutWorker(cfg, Registry(REDIS_URL, run), worker_id="rollout0")
    try:
        held = [p.prompt for p in worker.eval_set]
        assert [p for p, _ in rl_prompts(cfg.rl, cfg.run.seed).eval] == held and len(held) == 3
        trained = {p.prompt: p.meta for p in worker.next_prompts(50)}
        assert set(trained) <= {r["prompt"] for r in RECORDS} - set(held)
        assert all(meta["answer"] == str(meta["id"] ** 2) for meta in trained.values())
    finally:
        worker.close()
