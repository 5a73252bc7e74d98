"""Prompts and rewards of an RL run: a built-in task's generator, or JSONL records of the user's own.

Specification: `rl.prompts` records become (prompt, meta) pairs, meta being every other field; shuffled once by
run.seed, the first `rl.eval_prompts` are the evaluation's when `rl.eval_interval` is set and never trained on; the
rest are asked in epochs, each a new permutation of all of them by place in the run's order, the workers claiming
places from one shared counter (so no record twice in an epoch, whichever worker asks), which a starting trainer sets
to where its data position left off; `rl.reward` names a registered reward or a
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


def test_foldmoe_train_says_how_many_records_an_epoch_asks_and_how_many_epochs_the_run_makes(tmp_path, capsys,
                                                                                         monkeypatch):
    import services.launcher

    class NoLaunch:  # what is said before the services start is the point here
        def __init__(self, *_):
            pass

        def run(self) -> int:
            return 0

    monkeypatch.setattr(services.launcher, "Launcher", NoLaunch)
    code = cli.main(["train", "--config", "configs/rl_tiny.yaml", f"rl.prompts=[{write(tmp_path, RECORDS)}]",
                     "rl.reward=number", "rl.eval_interval=5", "rl.eval_prompts=4", "rl.groups_per_step=4",
                     "run.steps=10", f"run.dir={tmp_path / 'run'}"])
    assert code == 0
    assert ("rl.prompts: 16 records to train on, 4 held for evaluation; an epoch is 4 steps of 4 groups, 10 steps "
            "2.50 epochs") in capsys.readouterr().err


def write(tmp_path, records, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_records_split_into_evaluation_and_training_prompts_asked_in_epochs(tmp_path):
    rl = RLConfig(prompts=[write(tmp_path, RECORDS)], reward="number", eval_interval=5, eval_prompts=4)
    run = rl_prompts(rl, seed=7)
    assert len(run.eval) == 4 and run.eval == rl_prompts(rl, seed=7).eval != rl_prompts(rl, seed=8).eval
    assert all(meta == {"answer": str(r["id"] ** 2), "id": r["id"]} for (prompt, meta), r in
               ((e, RECORDS[e[1]["id"]]) for e in run.eval))
    held = {p for p, _ in run.eval}
    order = run.records
    assert len(order) == 16
    epochs = [[order.at(place) for place in range(e * 16, (e + 1) * 16)] for e in range(3)]
    for epoch in epochs:  # each epoch asks every training record once, and no evaluation record
        assert sorted(p for p, _ in epoch) == sorted({r["prompt"] for r in RECORDS} - held)
    assert [p for p, _ in epochs[0]] != [p for p, _ in epochs[1]] != [p for p, _ in epochs[2]]  # a new order each
    again = rl_prompts(rl, seed=7).records
    assert [again.at(place) for place in (40, 3, 17)] == [epochs[2][8], epochs[0][3], epochs[1][1]]  # by place alone
    epochs[0][0][1]["answer"] = "changed"
    assert order.at(0)[1]["answer"] != "changed"  # each ask is its own copy of the meta
    assert run.reward is number_reward and run.name == "prompts.jsonl" and run.generate is None
    no_eval = rl_prompts(RLConfig(prompts=rl.prompts, reward="number"), seed=7)
    assert no_eval.eval == [] and {no_eval.records.at(i)[0] for i in range(20)} == \
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
    assert rl_prompts(rl, seed=0).reward("p", "ab", {}) == 2.0  # no answer needed by this reward
    for spec, names in (("my_rewards:nope", "has no 'nope'"), ("my_rewards:NOT_CALLABLE", "not a function"),
                        ("no_such_module_xyz:f", "cannot import no_such_module_xyz"), ("nope", "no registered reward")):
        with pytest.raises(ConfigError, match=names):
            load_reward(spec)


def test_a_builtin_task_gives_the_prompts_it_gave_before(tmp_path):
    rl = RLConfig(task="arithmetic", eval_interval=2, eval_prompts=5)
    evaluation_rng = random.Random("3:evaluation")
    assert rl_prompts(rl, seed=3).eval == [arithmetic_prompt(evaluation_rng, rl.difficulty) for _ in range(5)]
    assert rl_prompts(rl, seed=3).records is None and rl_prompts(rl, seed=3).generate is arithmetic_prompt
    assert rl_prompts(RLConfig(task="arithmetic", reward="exact"), seed=3).reward is exact_reward
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


def test_rollout_workers_share_the_records_in_epochs(tmp_path):
    from services.common import rollout_stream
    from services.common.registry import Registry
    from services.common.config import load_config
    from services.rl_rollout.worker import RolloutWorker
    from test_rl_worker_ops import REDIS_URL, TINY

    path = write(tmp_path, RECORDS)
    run = f"rl-prompts-{uuid.uuid4().hex[:8]}"
    cfg = load_config("configs/rl_tiny.yaml", [f"run.name={run}", *TINY, f"rl.prompts=[{path}]", "rl.reward=number",
                                               "rl.eval_interval=2", "rl.eval_prompts=3"])
    registry = Registry(REDIS_URL, run)
    worker = RolloutWorker(cfg, registry, worker_id="rollout0")
    other = RolloutWorker(cfg, registry, worker_id="rollout1")
    try:
        held = [p.prompt for p in worker.eval_set]
        assert [p for p, _ in rl_prompts(cfg.rl, cfg.run.seed).eval] == held and len(held) == 3
        training = {r["prompt"] for r in RECORDS} - set(held)
        asked = worker.next_prompts(5) + other.next_prompts(7) + worker.next_prompts(5)  # one epoch: 17 records
        assert sorted(p.prompt for p in asked) == sorted(training)  # each once, across both workers
        assert sorted(p.seq for p in asked) == list(range(1, 18))
        assert all(p.meta["answer"] == str(p.meta["id"] ** 2) for p in asked)
        second = other.next_prompts(17)
        assert sorted(p.prompt for p in second) == sorted(training) and [p.seq for p in second] == list(range(18, 35))
        assert [p.prompt for p in second] != [p.prompt for p in asked]  # the next epoch, in another order
        registry.client.set(rollout_stream.prompt_cursor_key(worker.stream.key), 3)  # a trainer resumed after place 3
        assert [(p.prompt, p.seq) for p in worker.next_prompts(2)] == [(p.prompt, p.seq) for p in asked[3:5]]
        # places to be asked again (a dropped or lost group's) come first, each to one worker, then the counter's
        assert rollout_stream.ask_again(registry.client, worker.stream.key, [1, 0], 5.0) == [1, 0]
        assert rollout_stream.ask_again(registry.client, worker.stream.key, [1], 5.0) == []  # queued already
        by_seq = {p.seq: p.prompt for p in asked}
        assert [(p.prompt, p.seq) for p in worker.next_prompts(1)] == [(by_seq[2], 2)]
        assert [(p.prompt, p.seq) for p in other.next_prompts(2)] == [(by_seq[1], 1), (by_seq[6], 6)]
    finally:
        worker.close()
        other.close()
