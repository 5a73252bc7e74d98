"""Reward functions and the verifiable tasks that come with them.

A reward function is any callable `(prompt, completion, meta) -> float`; `meta` is what the task's prompt generator
attached to the prompt (the expected answer, the allowed numbers, ...). Functions and tasks are registered by name so a
config can pick them (`rl.task`).

Built-in tasks (reward 1.0 for a correct answer, 0.0 otherwise):
- `arithmetic`: "Compute 482 + 1937." with +, - or x over numbers of `difficulty` digits;
- `countdown`: reach a target with some of the given numbers, each used at most once, with + - * / and parentheses.

Built-in rewards for prompts of the user's own (`rl.prompts`, prompts.py), whose records carry an "answer":
- `number`: the completion's number (`extract_number`: after the last "answer:", "####" or "=") equals the answer;
- `exact`: the completion, stripped of surrounding whitespace, is the answer's text.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Protocol

RewardFn = Callable[[str, str, dict[str, Any]], float]


class PromptSource(Protocol):
    def __call__(self, rng: random.Random, difficulty: int) -> tuple[str, dict[str, Any]]: ...


@dataclass(frozen=True)
class Task:
    name: str
    make_prompt: PromptSource  # (rng, difficulty) -> (prompt text, meta for the reward)
    reward: RewardFn


REWARDS: dict[str, RewardFn] = {}
TASKS: dict[str, Task] = {}


def register_reward(name: str):
    def add(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered")
        REWARDS[name] = fn
        return fn
    return add


def register_task(task: Task) -> Task:
    if task.name in TASKS:
        raise ValueError(f"task {task.name!r} is already registered")
    TASKS[task.name] = task
    return task


def get_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise KeyError(f"unknown reward {name!r}; registered: {sorted(REWARDS)}")
    return REWARDS[name]


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r} (rl.task); registered: {sorted(TASKS)}")
    return TASKS[name]


# ---------------------------------------------------------------- answer extraction

# A number: optional sign, digits with optional thousands separators, optional decimals.
_NUMBER = re.compile(r"[-−]?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_MARKER = re.compile(r"(?:answer\s*(?:is|:|=)?|####|=)\s*", re.IGNORECASE)


def _answer_region(completion: str) -> str:
    """Text after the last answer marker ("answer:", "the answer is", "####", "="), else the whole completion."""
    ends = [m.end() for m in _MARKER.finditer(completion)]
    return completion[ends[-1]:] if ends else completion


def extract_number(completion: str) -> Fraction | None:
    """The first number in the answer region: "  1,234 apples" -> 1234, "Answer: -7." -> -7, "x" -> None."""
    m = _NUMBER.search(_answer_region(completion))
    if m is None:
        return None
    # any whitespace the pattern allows between sign and digits (a model can emit "-\x0c7"), not only a space
    text = re.sub(r"[\s,]", "", m.group()).replace("−", "-")
    return Fraction(text)


# ---------------------------------------------------------------- arithmetic

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def arithmetic_prompt(rng: random.Random, difficulty: int) -> tuple[str, dict[str, Any]]:
    lo, hi = 10 ** (difficulty - 1) if difficulty > 1 else 0, 10 ** difficulty - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    op = rng.choice(sorted(_OPS))
    return f"{a}{op}{b}=", {"answer": _OPS[op](a, b)}


def as_number(answer: Any) -> Fraction:
    """A record's answer as a number: 42, 0.5, "1,234", "-7" (ValueError / TypeError otherwise)."""
    if isinstance(answer, bool):
        raise TypeError("a boolean is not a number")
    if not isinstance(answer, (str, int, float)):
        raise TypeError(f"{type(answer).__name__} is not a number")
    return Fraction(re.sub(r"[\s,]", "", str(answer)).replace("−", "-"))  # str: a JSON 0.1 is the decimal 0.1


@register_reward("number")
def number_reward(prompt: str, completion: str, meta: dict[str, Any]) -> float:
    got = extract_number(completion)
    return 1.0 if got is not None and got == as_number(meta["answer"]) else 0.0


@register_reward("exact")
def exact_reward(prompt: str, completion: str, meta: dict[str, Any]) -> float:
    return 1.0 if completion.strip() == str(meta["answer"]).strip() else 0.0


arithmetic_reward = register_reward("arithmetic")(number_reward)
register_task(Task("arithmetic", arithmetic_prompt, arithmetic_reward))


# ---------------------------------------------------------------- countdown

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def countdown_prompt(rng: random.Random, difficulty: int) -> tuple[str, dict[str, Any]]:
    """`difficulty + 1` numbers; the target is the value of a random expression over all of them, so one solution
    always exists (a positive integer, which keeps targets readable)."""
    while True:
        numbers = [rng.randint(1, 12) for _ in range(max(2, difficulty + 1))]
        value = Fraction(numbers[0])
        for n in numbers[1:]:
            op = rng.choice(["+", "-", "*", "/"])
            value = value / n if op == "/" else _OPS[op](value, n)
        if value.denominator == 1 and 0 < value <= 1000:
            break
    shown = sorted(numbers)
    prompt = f"Using {', '.join(map(str, shown))} make {int(value)}. Answer:"
    return prompt, {"numbers": shown, "target": int(value)}


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        return _BINOPS[type(node.op)](left, right)  # ZeroDivisionError propagates: no value
    raise ValueError(f"not allowed in a countdown expression: {ast.dump(node)}")


def extract_expression(completion: str) -> str:
    """The arithmetic expression in the answer: the first line of the text after the last "answer" marker, cut at the
    first character that cannot belong to an expression; a trailing "= target" is dropped."""
    region = re.split(r"answer\s*(?:is|:)?", completion, flags=re.IGNORECASE)[-1].strip().splitlines()
    line = region[0] if region else ""
    line = line.replace("×", "*").replace("x", "*").replace("÷", "/").replace("−", "-")
    m = re.match(r"[\d\s+\-*/()]*", line)
    return m.group().strip() if m else ""


@register_reward("countdown")
def countdown_reward(prompt: str, completion: str, meta: dict[str, Any]) -> float:
    expr = extract_expression(completion)
    if not expr:
        return 0.0
    used: list[int] = []
    try:
        value = _evaluate(ast.parse(expr, mode="eval").body, used)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return 0.0
    if Counter(used) - Counter(meta["numbers"]):  # a number not given, or used more often than given
        return 0.0
    return 1.0 if value == meta["target"] else 0.0


register_task(Task("countdown", countdown_prompt, countdown_reward))
