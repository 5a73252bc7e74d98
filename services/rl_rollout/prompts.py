"""An RL run's prompts and reward: a built-in task's generator (`rl.task`), or records of the user's own (`rl.prompts`).

`rl.prompts` names JSONL files, one object per line with a string "prompt"; the record's other fields are the
reward's `meta` (an "answer" for the built-in `number` and `exact` rewards, checked here for every record). The records
are shuffled once by `run.seed`; with `rl.eval_interval`, the first `rl.eval_prompts` of them are the policy
evaluation's and are never trained on. The rest are asked in epochs: each epoch a permutation of all of them (by
`run.seed` and the epoch), its places claimed in turn by the workers from one counter in Redis, so that no record is
asked twice in an epoch however many workers share it. Each group records its place (`prompt_seq`); the dataloader's
position keeps the largest it consumed, and a run resumed from a checkpoint asks the records after it (the few that
were in flight when the checkpoint was saved are skipped, not asked twice). A built-in task's prompts are generated
by each worker from its own seed.

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
from services.rl_rollout.rewards import (REWARDS, PromptSource, RewardFn, Task, as_number, exact_reward, get_task,
                                         number_reward)

Prompt = tuple[str, dict[str, Any]]  # (prompt text, the reward's meta)
# What a built-in reward reads of a record, checked when the records are read: an "answer" it can compare with
ANSWER_CHECKS = {number_reward: as_number, exact_reward: str}


class RecordOrder:
    """`rl.prompts`' training records in the run's order: epoch after epoch, each a permutation of all of them by the
    run's seed. The workers claim places in this order from one counter (`rollout_stream.prompt_cursor_key`), so no
    record is asked twice within an epoch and every record is asked once before any is asked again."""

    def __init__(self, records: list[Prompt], seed: int):
        self.records, self.seed = records, seed
        self._epoch, self._order = -1, list[int]()

    def __len__(self) -> int:
        return len(self.records)

    def at(self, place: int) -> Prompt:
        """The record at `place` (0-based over the whole run), as the worker's own copy."""
        epoch, i = divmod(place, len(self.records))
        if epoch != self._epoch:  # places are claimed in increasing order: one permutation is built per epoch
            self._order = list(range(len(self.records)))
            random.Random(f"{self.seed}:epoch{epoch}").shuffle(self._order)
            self._epoch = epoch
        prompt, meta = self.records[self._order[i]]
        return prompt, dict(meta)


@dataclass(frozen=True)
class RLPrompts:
    name: str  # what each trajectory group records as its task
    reward: RewardFn
    eval: list[Prompt]  # the policy evaluation's prompts (rl.eval_prompts of them), the same for every worker
    generate: PromptSource | None = None  # a built-in task: (rng, difficulty) -> prompt, drawn by each worker's rng
    records: RecordOrder | None = None  # rl.prompts: the training records, asked in this order


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
    """The run's training prompts, reward and evaluation prompts; the same for every worker."""
    reward = load_reward(rl.reward) if rl.reward else _builtin(rl.task).reward
    evaluating = rl.eval_interval > 0
    if not rl.prompts:
        builtin = _builtin(rl.task)
        evaluation_rng = random.Random(f"{seed}:evaluation")
        evaluation = [builtin.make_prompt(evaluation_rng, rl.difficulty) for _ in range(rl.eval_prompts)]
        return RLPrompts(builtin.name, reward, evaluation if evaluating else [], generate=builtin.make_prompt)
    records = read_records(rl.prompts, reward)
    random.Random(f"{seed}:prompts").shuffle(records)
    held = rl.eval_prompts if evaluating else 0
    if len(records) <= held:
        raise ConfigError(f"`rl.prompts` holds {len(records)} records, and `rl.eval_prompts={rl.eval_prompts}` of them "
                          "are the evaluation's: none would be left to train on; add records or lower "
                          "rl.eval_prompts")
    name = "+".join(Path(p).name for p in rl.prompts)
    return RLPrompts(name, reward, records[:held], records=RecordOrder(records[held:], seed))
