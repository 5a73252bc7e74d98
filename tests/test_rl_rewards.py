"""Reward functions: answers are recognised however they are formatted, wrong or malformed answers score zero, and the
task generators only produce solvable prompts."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from services.rl_rollout import rewards
from services.rl_rollout.rewards import (Task, countdown_reward, extract_expression, extract_number, get_reward, get_task,
                                         register_reward)


@pytest.mark.parametrize("text, expected", [
    ("42", 42), ("  42  ", 42), ("42.\nThen I went home", 42), ("Answer: 1,234", 1234), ("answer:-7 ok", -7),
    ("The answer is 12 345", 12), ("I think 3 then... answer = 99", 99), ("#### 1,000,000", 1000000),
    ("ANSWER:   56 apples", 56), ("2.5", Fraction(5, 2)), ("12+3= 15", 15), ("- 7", -7),
    ("-\x0c0\n", 0), ("-\t3", -3),  # whatever whitespace a sampled completion puts after the sign
])
def test_numbers_are_extracted_from_loosely_formatted_answers(text, expected):
    assert extract_number(text) == expected


@pytest.mark.parametrize("text", ["", "no digits here", "answer: none"])
def test_no_number_means_no_answer(text):
    assert extract_number(text) is None


def test_arithmetic_reward_is_one_exactly_for_the_right_value():
    reward = get_reward("arithmetic")
    assert reward("12*11=", " 132 is it", {"answer": 132}) == 1.0
    assert reward("12*11=", "1,32", {"answer": 132}) == 0.0
    assert reward("12*11=", "131", {"answer": 132}) == 0.0
    assert reward("12*11=", "", {"answer": 132}) == 0.0


def test_arithmetic_prompts_carry_their_answer():
    task, rng = get_task("arithmetic"), random.Random(0)
    for _ in range(50):
        prompt, meta = task.make_prompt(rng, 3)
        assert prompt.endswith("=")
        assert eval(prompt[:-1]) == meta["answer"]  # noqa: S307 -- the prompt is our own digits-and-operator text
        assert task.reward(prompt, str(meta["answer"]), meta) == 1.0


@pytest.mark.parametrize("completion, score", [
    (" (12-2)*10", 1.0), (" 10 * (12 - 2) = 100\nso that's it", 1.0), ("The answer is 10x(12-2)", 1.0),
    (" 12*10-2*10", 0.0),  # the right value, but 10 is given once and used twice
    (" 12*10", 0.0),  # wrong value
    (" 100", 0.0),  # a number not given
    (" (12-2)/0", 0.0), (" __import__('os')", 0.0), (" 12-", 0.0), ("", 0.0),
])
def test_countdown_reward_checks_value_and_number_usage(completion, score):
    assert countdown_reward("", completion, {"numbers": [2, 10, 12], "target": 100}) == score


def test_countdown_allows_unused_numbers_but_not_reused_ones():
    meta = {"numbers": [3, 3, 4, 7], "target": 9}
    assert countdown_reward("", "3+3+", meta) == 0.0  # not an expression
    assert countdown_reward("", "3*3", meta) == 1.0
    assert countdown_reward("", "3*3*1", meta) == 0.0  # 1 is not given
    assert extract_expression("Answer: 3 × 3 = 9") == "3 * 3"


def test_countdown_prompts_are_solvable_by_construction():
    task, rng = get_task("countdown"), random.Random(1)
    for _ in range(30):
        prompt, meta = task.make_prompt(rng, 3)
        assert len(meta["numbers"]) == 4 and 0 < meta["target"] <= 1000
        assert str(meta["target"]) in prompt and all(str(n) in prompt for n in meta["numbers"])


def test_registry_rejects_duplicates_and_names_the_known_entries():
    with pytest.raises(ValueError, match="already registered"):
        register_reward("arithmetic")(lambda p, c, m: 0.0)
    with pytest.raises(KeyError, match="arithmetic"):
        get_task("poetry")
    register_reward("test_length")(lambda p, c, m: float(len(c)))
    try:
        assert get_reward("test_length")("p", "abc", {}) == 3.0
    finally:
        del rewards.REWARDS["test_length"]
    assert isinstance(get_task("countdown"), Task)
