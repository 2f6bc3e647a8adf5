"""Pure: the stored history as the engine's messages (tool calls and results replayed),
the one checker of the engine's options, the Responses API's tools and tool items in the
engine's shape, and the idempotency fingerprint that holds the options."""

from __future__ import annotations

from typing import Any

import pytest

from relay.protocol.codes import Refusal
from worker.chat.prompt import NewInput, as_entry, history_messages, new_input
from worker.chat.store import History
from worker.chat.turnstate import request_fingerprint
from worker.fronts.errors import WireError
from worker.fronts.options import engine_options, refusal_code
from worker.fronts.responses.request import parse_responses

CALL = {"type": "tool-call", "id": "c1", "name": "weather", "text": '{"city": "Oslo"}'}


def _call(cid: str, name: str, args: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def test_a_reply_with_tool_calls_is_replayed_with_them_and_the_results_after_it() -> None:
    entries = [
        {"role": "user", "content": "Weather?", "turn": 1},
        {"role": "assistant", "content": "Let me look.", "turn": 1, "parts": [
            {"type": "reasoning", "id": "r1", "text": "think"},
            {"type": "text", "text": "Let me look."}, CALL,
        ]},
        {"role": "tool", "content": '{"t": 4}', "tool_call_id": "c1", "turn": 2},
        {"role": "assistant", "content": "4 degrees.", "turn": 2},
    ]  # fmt: skip
    assert history_messages(entries) == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.",
         "tool_calls": [_call("c1", "weather", '{"city": "Oslo"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"t": 4}'},
        {"role": "assistant", "content": "4 degrees."},
    ]  # fmt: skip
    hist = History(None, history_messages(entries), None, entries)
    assert hist.before(2) == history_messages(entries[:2])


def test_a_result_inside_a_reply_splits_it_as_a_multi_step_agent_reads() -> None:
    parts = [CALL, {"type": "tool-result", "id": "c1", "text": "4"},
             {"type": "text", "text": "It is 4."}, {"type": "data-x", "id": "d", "text": "1"},
             {"type": "tool-call", "id": "c2", "name": "w", "text": "", "done": False}]  # fmt: skip
    out = history_messages([{"role": "assistant", "content": "It is 4.", "parts": parts}])
    assert out == [
        {"role": "assistant", "content": "", "tool_calls": [_call("c1", "weather", CALL["text"])]},
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
        {"role": "assistant", "content": "It is 4."},  # an unfinished call is not sent
    ]


def test_a_client_message_stored_as_it_is_comes_back_the_same() -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [_call("c1", "f", "{}")]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
    ]
    assert history_messages([as_entry(m) for m in msgs]) == msgs


def test_the_one_checker_refuses_unknown_fields_and_wrong_types_by_name() -> None:
    body = {"message": "x", "tools": [{"type": "function", "function": {"name": "f"}}],
            "seed": 1, "stop": None}  # fmt: skip
    assert engine_options(body, frozenset({"message"})) == {"tools": body["tools"], "seed": 1}
    for bad, param, code in (
        ({"functions": []}, "functions", Refusal.UNSUPPORTED_PARAMETER),
        ({"seed": True}, "seed", Refusal.INVALID_OPTION),
        ({"tools": [{"type": "web_search"}]}, "tools", Refusal.INVALID_OPTION),
        ({"tools": [{"type": "function", "function": [None]}]}, "tools", Refusal.INVALID_OPTION),
        ({"tool_choice": ["auto"]}, "tool_choice", Refusal.INVALID_OPTION),
        ({"tool_choice": {"function": "f"}}, "tool_choice", Refusal.INVALID_OPTION),
        ({"stop": ["a"] * 5}, "stop", Refusal.INVALID_OPTION),
    ):
        with pytest.raises(WireError) as err:
            engine_options(bad)
        assert (err.value.param, refusal_code(err.value)) == (param, code)
        assert param in err.value.message


def _responses(body: dict[str, Any]) -> Any:
    return parse_responses({"model": "m", **body}, model="m", default_max_tokens=16,
                           max_tokens_limit=64, max_chars=10_000)  # fmt: skip


def test_responses_function_tools_and_items_in_the_engines_shape() -> None:
    req = _responses({
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
        "input": [
            {"role": "user", "content": "q"},
            {"type": "reasoning", "id": "rs", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
            {"type": "function_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "2"}]},
        ],
    })  # fmt: skip
    assert req.options == {
        "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        ],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "parallel_tool_calls": False,
    }
    assert req.earlier == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [_call("c1", "f", "{}"),
                                                             _call("c2", "f", "{}")]},
    ]  # fmt: skip
    assert req.tool_results == [{"role": "tool", "tool_call_id": "c1", "content": "1"},
                                {"role": "tool", "tool_call_id": "c2", "content": "2"}]  # fmt: skip
    assert req.message == ""
    assert req.params()["tools"][0]["name"] == "f"  # echoed as the request gave it
    more = _responses({"input": [
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"role": "user", "content": "and now?"},
    ]})  # fmt: skip
    assert (more.message, more.earlier) == ("and now?", [])
    assert more.tool_results == [{"role": "tool", "tool_call_id": "c1", "content": "1"}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search_preview"}]}, "tools"),
        ({"tools": [{"type": "function", "name": "f", "x": 1}]}, "tools"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"tool_choice": {"type": "function"}}, "tool_choice"),
        ({"input": [{"type": "function_call", "call_id": "c"}]}, "input[0]"),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id"),
        ({"input": [{"type": "computer_call_output"}]}, "input[0]"),
        (
            {"input": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            "input",
        ),
    ],
)
def test_responses_refuse_what_the_engine_cannot_run_by_name(
    body: dict[str, Any], param: str
) -> None:
    with pytest.raises(WireError) as err:
        _responses({"input": "q", **body})
    assert (err.value.status, err.value.param) == (400, param)


def test_the_fingerprint_holds_options_and_results_and_keeps_the_old_one_without() -> None:
    plain = request_fingerprint("m", None, 16)
    assert plain == request_fingerprint("m", None, 16, None, {}, ())
    hot = request_fingerprint("m", None, 16, None, {"temperature": 0.9})
    assert len({plain, hot, request_fingerprint("m", None, 16, None, {"temperature": 0.1})}) == 3
    results = ({"role": "tool", "tool_call_id": "c", "content": "1"},)
    assert request_fingerprint("", None, 16, None, None, results) != request_fingerprint(
        "", None, 16, None, None, ({**results[0], "content": "2"},)
    )


def test_the_new_input_is_the_users_message_or_the_tools_results_before_it() -> None:
    u, a = {"role": "user", "content": "q"}, {"role": "assistant", "content": ""}
    t1, t2 = ({"role": "tool", "tool_call_id": c, "content": "1"} for c in ("c1", "c2"))
    assert new_input([u, a, t1, t2]) == NewInput([u, a], [t1, t2], "")
    assert new_input([u, a, t1, {"role": "user", "content": "and?"}]) == NewInput(
        [u, a], [t1], "and?"
    )
    assert new_input([u]) == NewInput([], [], "q")
    for bad in ([], [u, a], [{"role": "user", "content": " "}]):
        assert new_input(bad) is None


def test_a_result_whose_call_left_the_history_is_not_sent() -> None:
    """The history keeps its newest messages: a reply with calls may have gone while a
    result of them stayed; the engine would refuse that result on every later turn."""
    entries = [
        {"role": "tool", "content": "4", "tool_call_id": "gone"},
        {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "and?"},
    ]
    assert history_messages(entries) == [
        {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "and?"},
    ]
