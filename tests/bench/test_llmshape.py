"""The LLM-rate phases' schedule (``bench.peers.llmshape``) and their aims
(``bench.peers.pathaims``): pure, no I/O."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import pytest

from bench.peers.llmshape import REPLY, draw, even_ticks, mean_rate, session_of, ticks
from bench.peers.pathaims import aims
from bench.peers.pathsystem import Phase


def test_draw_is_seeded_and_each_reply_streams_at_the_session_rate() -> None:
    plan = draw(200, 60.0, 8.0, seed=3)
    assert plan == draw(200, 60.0, 8.0, seed=3)
    assert plan != draw(200, 60.0, 8.0, seed=4)
    for replies in plan:
        for start, tokens in replies:
            assert 0.0 <= start < 8.0
            assert 1 <= tokens <= REPLY.max_tokens
        for (start, tokens), nxt in pairwise(replies):
            # the next turn starts after this reply and a gap of at least 5 s
            assert nxt[0] >= start + tokens / 60.0 + 5.0 - 1e-9
    # the stationary mix: some sessions mid-reply at 0, most between turns
    replying = sum(1 for r in plan if r and r[0][0] == 0.0)
    assert 0 < replying < 100


def test_ticks_put_every_due_token_once_and_mark_each_reply_start() -> None:
    plan = [[(0.0, 10), (0.5, 3)], [], [(0.95, 100)]]
    got = ticks(plan, rate=100.0, seconds=1.0)
    assert len(got) == 100
    flat = [e for t in got for e in t]
    assert sum(1 for e in flat if session_of(e) == 0) == 13
    assert sum(1 for e in flat if session_of(e) == 2) == 5  # cut at the round's end
    assert not any(session_of(e) == 1 for e in flat)
    assert (got[0], got[50], got[95]) == ([-1], [-1], [-3])  # first tokens
    assert (got[1], got[96]) == ([0], [2])


def test_even_ticks_is_todays_pacing() -> None:
    got = even_ticks(4, 50.0, 0.1)  # 0.5 per tick: every other tick, half the sessions
    assert got == [[0, 2], [1, 3]] * 5


def test_mean_rate_matches_the_draws_order_of_magnitude() -> None:
    want = mean_rate(400, 60.0)
    plan = ticks(draw(400, 60.0, 8.0, seed=1), 60.0, 8.0)
    seen = sum(len(t) for t in plan) / 8.0
    assert 0.5 * want < seen < 2.0 * want


def _sys(whole: float, p99: float, lost: int = 0, dup: int = 0) -> dict[str, Any]:
    us = {"producer": whole / 4, "redis": whole / 2, "server": whole / 4, "whole": whole}
    return {"us_per_token": us, "p99_ms": p99, "lost": lost, "duplicated": dup,
            "kept_up": True, "behind_s": 0.0}  # fmt: skip


def test_llm_aims_ratio_window_and_storm() -> None:
    one = Phase("llm60_400x1", 400, 1, 3000, 3.0, "llm", 60)
    storm = Phase("llm60_storm_400x1", 400, 1, 3000, 3.0, "llm_storm", 60)
    results = {
        one.name: {
            "tokenrelay": _sys(90.0, 70.0),
            "centrifugo": _sys(100.0, 30.0),
            "socketio-streams": _sys(120.0, 10.0),
        },
        storm.name: {"tokenrelay": _sys(90.0, 1200.0, lost=1)},
    }
    judged = aims({one.name: one, storm.name: storm}, results, {"socketio-streams": "no npm"}, 50.0)
    got = {(a["phase"], a["aim"]): a for a in judged}
    cf = got[(one.name, "whole CPU/token vs centrifugo")]
    assert cf["ratio"] == pytest.approx(0.9)
    assert cf["met"]
    ss = got[(one.name, "whole CPU/token vs socketio-streams")]
    assert ss["ratio"] == pytest.approx(0.75)
    assert not ss["met"]
    assert got[(one.name, "p99 vs centrifugo + 50 ms window")]["met"]  # 70 <= 30 + 50
    assert not got[(one.name, "p99 vs socketio-streams + 50 ms window")]["met"]  # 70 > 60
    assert not got[(storm.name, "storm: p99 < 1 s, 0 lost, 0 dup")]["met"]
    absent = got[(storm.name, "whole CPU/token vs socketio-streams")]
    assert absent["met"] is None
    assert "no npm" in absent["missed_by"]
