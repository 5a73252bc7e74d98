"""An RL run's prompts and reward: a built-in task's generator (`rl.task`), or records of the user's own (`rl.prompts`).

`rl.prompts` names JSONL files, one object per line with a string "prompt"; the record's other fields are the
reward's `meta` (an "answer" for the built-in `number` and `exact` rewards, checked here for every record). The records
are shuffled once by `run.seed`; with `rl.eval_interval`, the first `rl.eval_prompts` of them are the policy
evaluation's and are never trained on; each worker draws its training prompts from the rest at random, by its own
seed (as it draws a generator task's).

`rl.reward` names the reward: a registered one (rewards.py) or `module:function`, a callable
`(prompt, completion, meta) -> float` that every rollout worker can import; empty: `rl.task`'s own.
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.config import ConfigError, RLConfig
from services.common.jsonl import JSONLError, jsonl_records
from services.rl_rollout.rewards import REWARDS, RewardFn, Task, as_number, exact_reward, get_task, number_reward

Prompt = tuple[str, dict[str, Any]]  # (prompt text, the reward's meta)
# What a built-in reward reads of a record, checked when the records are read: an "answer" it can compare with
ANSWER_CHECKS = {number_reward: as_number, exact_reward: str}


@dataclass(frozen=True)
class RLPrompts:
    task: Task  # its make_prompt draws the training prompts, its reward scores completions
    eval: list[Prompt]  # the policy evaluation's prompts (rl.eval_prompts of them), the same for every worker


def _builtin(name: str) -> Task:
    try:
        return get_task(name)
    except KeyError as e:
        raise ConfigError(e.args[0]) from None


def load_reward(spec: str) -> RewardFn:
    """A registered reward by name, or `module:function`."""
    if ":" not in spec:
        if spec not in REWARDS:
            raise ConfigError(f"`rl.reward={spec}` is no registered reward ({', '.join(sorted(REWARDS))}); name one "
                              "or a callable as module:function")
        return REWARDS[spec]
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise ConfigError(f"`rl.reward={spec}`: cannot import {module} ({e}); put it on PYTHONPATH") from None
    except AttributeError:
        raise ConfigError(f"`rl.reward={spec}`: module {module} has no {name!r}") from None
    if not callable(fn):
        raise ConfigError(f"`rl.reward={spec}` is a {type(fn).__name__}, not a function (prompt, completion, meta)")
    return fn


def read_records(paths: list[str], reward: RewardFn | None, key: str = "`rl.prompts`") -> list[Prompt]:
    """Every record of the JSONL files, in file order; a malformed one is refused naming its file and line (and `key`,
    the option that named the files)."""
    check = ANSWER_CHECKS.get(reward)
    records: list[Prompt] = []
    for path in paths:
        try:
            for lineno, record in jsonl_records(path):
                if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
                    raise ConfigError(f"{key}: {path}:{lineno} has no non-empty string \"prompt\" field")
                meta = {k: v for k, v in record.items() if k != "prompt"}
                if check is not None:
                    try:
                        check(meta["answer"])
                    except (KeyError, TypeError, ValueError, ZeroDivisionError):
                        raise ConfigError(f"{key}: {path}:{lineno} has no \"answer\" the reward can compare with "
                                          f"(got {meta.get('answer', 'none')!r})") from None
                records.append((record["prompt"], meta))
        except JSONLError as e:
            raise ConfigError(f"{key}: {e}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{key}: cannot read {path} ({e})") from None
    if not records:
        raise ConfigError(f"{key}: {', '.join(paths)} hold(s) no records")
    return records


def rl_prompts(rl: RLConfig, seed: int) -> RLPrompts:
    """The run's task (training prompts and reward) and evaluation prompts; the same for every worker."""
    reward = load_reward(rl.reward) if rl.reward else _builtin(rl.task).reward
    evaluating = rl.eval_interval > 0
    if not rl.prompts:
        builtin = _builtin(rl.task)
        evaluation_rng = random.Random(f"{seed}:evaluation")
        evaluation = [builtin.make_prompt(evaluation_rng, rl.difficulty) for _ in range(rl.eval_prompts)]
        return RLPrompts(Task(builtin.name, builtin.make_prompt, reward), evaluation if evaluating else [])
    records = read_records(rl.prompts, reward)
    random.Random(f"{seed}:prompts").shuffle(records)
    held = rl.eval_prompts if evaluating else 0
    if len(records) <= held:
        raise ConfigError(f"`rl.prompts` holds {len(records)} records, and `rl.eval_prompts={rl.eval_prompts}` of them "
                          "are the evaluation's: none would be left to train on; add records or lower "
                          "rl.eval_prompts")
    training = records[held:]

    def draw(rng: random.Random, difficulty: int) -> Prompt:
        prompt, meta = rng.choice(training)
        return prompt, dict(meta)  # the worker's copy

    name = "+".join(Path(p).name for p in rl.prompts)
    return RLPrompts(Task(name, draw, reward), records[:held])
