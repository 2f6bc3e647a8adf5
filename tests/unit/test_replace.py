"""Which stored turn a regenerate or an edit replaces (worker.chat.replace, pure)."""

from __future__ import annotations

from typing import Any

import pytest

from worker.chat.replace import NothingToRegenerate, Replace, UnknownReplaced, resolve_replace
from worker.chat.store import History

ENTRIES: list[dict[str, Any]] = [
    {"role": "user", "content": "one", "turn": 1, "id": "u1"},
    {"role": "assistant", "content": "r1", "turn": 1, "id": "s-1"},
    {"role": "user", "content": "two", "turn": 2, "id": "u2"},
    {"role": "assistant", "content": "r2", "turn": 2, "id": "s-2"},
]
MESSAGES = [{"role": str(e["role"]), "content": str(e["content"])} for e in ENTRIES]
HIST = History(None, MESSAGES, None, ENTRIES)


def test_a_new_turn_replaces_nothing() -> None:
    assert resolve_replace(HIST, None, "three") == (None, "three", None)


def test_regenerate_asks_the_newest_turn_again_and_keeps_its_message_id() -> None:
    assert resolve_replace(HIST, Replace(), None) == (2, "two", "u2")
    assert resolve_replace(HIST, Replace(turn=1), None) == (1, "one", "u1")
    assert HIST.before(2) == [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "r1"},
    ]


def test_an_edit_by_turn_or_by_message_id() -> None:
    assert resolve_replace(HIST, Replace(turn=1), "uno") == (1, "uno", "u1")
    assert resolve_replace(HIST, Replace(message_id="s-2"), None) == (2, "two", "u2")
    assert resolve_replace(HIST, Replace(message_id="u1"), "uno") == (1, "uno", "u1")


def test_what_the_history_lacks() -> None:
    with pytest.raises(NothingToRegenerate):
        resolve_replace(History(None, [], None, []), Replace(), None)
    with pytest.raises(UnknownReplaced) as turn:
        resolve_replace(HIST, Replace(turn=9), None)
    assert turn.value.what == "turn"
    with pytest.raises(UnknownReplaced) as msg:
        resolve_replace(HIST, Replace(message_id="nope"), "x")
    assert msg.value.what == "message"
