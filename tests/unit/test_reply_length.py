"""The mock engine's reply lengths: realistic on average, a long tail, the same per prompt."""

from __future__ import annotations

import statistics

import pytest

from devstack.mockengine.prefix_cache import prompt_tokens
from devstack.mockengine.reply_length import ReplyLength


def _prompt(i: int) -> list[str]:
    return prompt_tokens([{"role": "user", "content": f"question number {i}"}])


def test_default_lengths_average_300_with_a_tail_to_2000() -> None:
    dist = ReplyLength()
    lengths = [dist.length(_prompt(i)) for i in range(5000)]
    assert 270 <= statistics.mean(lengths) <= 330
    assert min(lengths) >= 8
    assert max(lengths) <= 2000
    assert sum(n > 1000 for n in lengths) >= 20  # a real tail, not a narrow bell
    assert sum(n < 100 for n in lengths) >= 250  # and short answers too


def test_the_same_prompt_always_gets_the_same_length() -> None:
    a, b = ReplyLength(), ReplyLength()
    assert [a.length(_prompt(i)) for i in range(50)] == [b.length(_prompt(i)) for i in range(50)]
    assert len({a.length(_prompt(i)) for i in range(50)}) > 30


def test_flags_shape_it_and_bad_values_are_refused() -> None:
    assert {ReplyLength(mean=40, sigma=0).length(_prompt(i)) for i in range(20)} == {40}
    short = ReplyLength(mean=30, max_tokens=48, min_tokens=8)
    assert all(8 <= short.length(_prompt(i)) <= 48 for i in range(500))
    for bad in ({"mean": 0}, {"sigma": -1}, {"min_tokens": 0}, {"min_tokens": 9, "max_tokens": 8}):
        with pytest.raises(ValueError):
            ReplyLength(**bad)
