"""A reply's parts as the Responses API's events (relay/fronts/responses/wire.py), pure:
function-call items with their argument deltas, a reasoning item, a citation, checked
against the ``openai`` SDK's own event types and its stream accumulator, numbered from
the backlog alone (a resume from any event number gets the rest)."""

from __future__ import annotations

from typing import Any

from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from relay.fronts.responses.wire import ResponseId, ResponseTurn
from relay.protocol.parts import PartRef
from tests.unit.test_parts import frame, pf, reply

EVENTS = TypeAdapter(ResponseStreamEvent)
SID = "parts"


def _events(frames: list[Any], after: int = -1) -> list[dict[str, Any]]:
    rt = ResponseTurn(ResponseId(SID, 1, 1), starting_after=after)
    out = [e for f in frames for e in rt.feed(f)]
    assert rt.finished
    return out


def _frames() -> list[Any]:
    frames, _ = reply()
    done = frames[-1]
    extra = [
        pf(done.offset, PartRef("source", "s1"), '{"url":"https://example.org/w","title":"W"}'),
        pf(done.offset + 1, PartRef("reasoning", "r2", "start", summary=True)),
        pf(done.offset + 2, PartRef("reasoning", "r2", "delta"), "In short: weather."),
        pf(done.offset + 3, PartRef("reasoning", "r2", "end")),
    ]
    return [*frames[:-1], *extra, frame(done.offset + 4, "done", "", done.meta)]


def test_parts_are_output_items_the_sdk_accumulates() -> None:
    events = _events(_frames())
    seqs = [e["sequence_number"] for e in events]
    assert seqs == sorted(set(seqs))
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for e in events:
        state.handle_event(EVENTS.validate_python(e))  # the SDK's types and its accumulator
    final = Response.model_validate(events[-1]["response"])
    kinds = [(o.type, getattr(o, "name", None)) for o in final.output]
    assert kinds == [("message", None), ("reasoning", None), ("function_call", "weather"),
                     ("reasoning", None)]  # fmt: skip
    call = final.output[2]
    assert call.type == "function_call"
    assert (call.call_id, call.arguments, call.status) == (
        "call_1",
        '{"city": "Oslo"}',
        "completed",
    )
    reasoning = final.output[1]
    assert reasoning.type == "reasoning"
    assert reasoning.content is not None
    assert reasoning.content[0].text == "Let me think"
    assert final.output[3].summary[0].text == "In short: weather."  # type: ignore[union-attr]
    msg = final.output[0]
    assert msg.type == "message"
    note = msg.content[0].annotations[0]  # type: ignore[union-attr]
    assert note.url == "https://example.org/w"  # type: ignore[union-attr]
    types = [e["type"] for e in events]
    assert types.count("response.function_call_arguments.delta") == 3
    assert "response.function_call_arguments.done" in types


def test_a_resume_from_any_event_number_gets_exactly_the_rest() -> None:
    frames = _frames()
    full = _events(frames)
    for after in range(-1, full[-1]["sequence_number"] + 1):
        assert _events(frames, after) == [e for e in full if e["sequence_number"] > after]
