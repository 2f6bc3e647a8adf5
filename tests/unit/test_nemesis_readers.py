"""The nemesis's check of AI SDK UI streams against the backlog (bench.faults.readers):
a turn read to its end must have the backlog's text and its kind of end."""

from __future__ import annotations

from typing import Any, cast

import aiohttp

from bench.faults.readers import UiReader, UiTurnSeen, check_ui
from bench.load.accounting import SessionLog


def _log(sid: str) -> SessionLog:
    log = SessionLog(sid)
    frames: list[dict[str, Any]] = [
        {"offset": 1, "kind": "meta", "turn": 1, "epoch": 1},
        {"offset": 2, "kind": "token", "turn": 1, "epoch": 1, "text": "Hel"},
        {"offset": 3, "kind": "token", "turn": 1, "epoch": 1, "text": "lo"},
        {"offset": 4, "kind": "done", "turn": 1, "epoch": 1, "meta": {}},
        {"offset": 5, "kind": "meta", "turn": 2, "epoch": 2},
        {"offset": 6, "kind": "token", "turn": 2, "epoch": 2, "text": "Wor"},
        {"offset": 7, "kind": "error", "turn": 2, "epoch": 3, "text": "worker lost"},
    ]
    for f in frames:
        log.add(f)
    return log


def _reader(sid: str, turns: dict[int, UiTurnSeen]) -> UiReader:
    u = UiReader(cast(aiohttp.ClientSession, None), list, sid, "t")
    u.turns = turns
    return u


def test_turns_read_as_the_backlog_holds_them_pass() -> None:
    r = check_ui(
        [
            _reader(
                "s", {1: UiTurnSeen("Hello", "stop", False), 2: UiTurnSeen("Wor", "error", False)}
            )
        ],
        {"s": _log("s")},
    )
    assert (r["ui_mismatches"], r["ui_turns_checked"]) == (0, 2)


def test_another_text_or_another_end_is_a_mismatch() -> None:
    r = check_ui(
        [_reader("s", {1: UiTurnSeen("Help", "stop", False), 2: UiTurnSeen("Wor", "stop", False)})],
        {"s": _log("s")},
    )
    assert r["ui_mismatches"] == 2
    assert r["ui_mismatch_samples"][0] == "s/1: UI stop 4 chars, backlog done 5 chars"


def test_a_turn_a_gap_cut_into_is_told_not_compared_and_a_turn_read_two_ways_is_not() -> None:
    u = _reader("s", {1: UiTurnSeen("Hel", "error", True)})
    u.reread_differs.append(2)
    r = check_ui([u], {"s": _log("s")})
    assert (r["ui_gaps"], r["ui_turns_checked"], r["ui_mismatches"]) == (1, 0, 1)


def test_a_differing_turn_a_writer_took_over_after_a_failover_is_counted_apart() -> None:
    """A stream that ended on frames a failover then lost: the skip's gap frame sits
    inside the turn in the backlog, after the stream had ended."""
    log = SessionLog("s")
    frames: list[dict[str, Any]] = [
        {"offset": 1, "kind": "meta", "turn": 1, "epoch": 1},
        {"offset": 2, "kind": "token", "turn": 1, "epoch": 1, "text": "Hel"},
        {"offset": 1 + (1 << 20), "kind": "gap", "turn": 0, "epoch": 0,
         "meta": {"code": "lost_in_failover", "from": 3, "to": 2 + (1 << 20)}},
        {"offset": 3 + (1 << 20), "kind": "error", "turn": 1, "epoch": 2, "text": "worker lost"},
    ]  # fmt: skip
    for f in frames:
        log.add(f)
    r = check_ui([_reader("s", {1: UiTurnSeen("Hello", "error", False)})], {"s": log})
    assert (r["ui_mismatches"], r["ui_lost_writes"]) == (0, 1)
    assert r["ui_lost_write_samples"] == ["s/1: UI error 5 chars, backlog error 3 chars"]
