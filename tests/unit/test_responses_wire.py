"""The Responses API's pure parts: ids, the frames -> events translation (numbers from
offsets, a resume's filter, the ends), and the request body's checks."""

from __future__ import annotations

from typing import Any

import pytest

from relay.fronts.responses.wire import (
    InvalidResponseId,
    ResponseId,
    ResponseTurn,
    encode_event,
    parse_conversation_id,
    parse_response_id,
)
from relay.protocol.frame import Frame
from worker.fronts.errors import WireError
from worker.fronts.responses.request import parse_responses

RID = ResponseId("s_1-x", 2, 10)


def frame(offset: int, kind: str, text: str = "", turn: int = 2, **meta: Any) -> Frame:
    return Frame(session="s_1-x", turn=turn, offset=offset, kind=kind, text=text,  # type: ignore[arg-type]
                 ts=1_700_000_000_500, meta=meta or None)  # fmt: skip


PARAMS = {"model": "m", "instructions": "be brief", "metadata": {"k": "v"},
          "max_output_tokens": 5, "previous_response_id": None, "background": True}  # fmt: skip
TURN = [
    frame(9, "done", turn=1),  # the previous turn: ignored
    frame(10, "meta", message="hi", response=PARAMS, model="m"),
    frame(11, "token", "Hel"),
    frame(12, "token", "lo"),
    frame(13, "done", finish_reason="stop", tokens=2, prompt_tokens=7, cached_tokens=3),
    frame(14, "meta", turn=3),  # the next turn: ignored
]


def events(rt: ResponseTurn, frames: list[Frame]) -> list[dict[str, Any]]:
    return [e for f in frames for e in rt.feed(f)]


def test_ids_name_the_session_the_turn_and_its_first_offset() -> None:
    assert str(RID) == "resp_s_1-x_2_10"
    assert parse_response_id("resp_s_1-x_2_10") == RID
    assert RID.message_id == "msg_s_1-x_2"
    for bad in (
        "resp_s_2",
        "resp__2_10",
        "msg_s_2_10",
        "resp_s_0_10",
        "resp_s_2_x",
        "resp_a b_2_1",
    ):
        with pytest.raises(InvalidResponseId):
            parse_response_id(bad)
    assert parse_conversation_id("conv_s_1-x") == "s_1-x"
    with pytest.raises(InvalidResponseId):
        parse_conversation_id("s_1-x")


def test_a_turn_is_every_event_numbered_from_its_offsets() -> None:
    out = events(ResponseTurn(RID), TURN)
    assert [(e["type"], e["sequence_number"]) for e in out] == [
        ("response.created", 0), ("response.in_progress", 1),
        ("response.output_item.added", 2), ("response.content_part.added", 3),
        ("response.output_text.delta", 4), ("response.output_text.delta", 5),
        ("response.output_text.done", 6), ("response.content_part.done", 7),
        ("response.output_item.done", 8), ("response.completed", 9),
    ]  # fmt: skip
    created, done = out[0]["response"], out[-1]["response"]
    assert created["status"] == "in_progress"
    assert created["output"] == []
    assert created["created_at"] == 1_700_000_000
    assert created["instructions"] == "be brief"
    assert created["metadata"] == {"k": "v"}
    assert created["conversation"] == {"id": "conv_s_1-x"}
    assert done["status"] == "completed"
    assert done["output"][0]["content"][0]["text"] == "Hello"
    assert done["usage"] == {"input_tokens": 7, "output_tokens": 2, "total_tokens": 9,
                             "input_tokens_details": {"cached_tokens": 3, "cache_write_tokens": 0},
                             "output_tokens_details": {"reasoning_tokens": 0}}  # fmt: skip
    assert out[6]["text"] == "Hello"
    assert encode_event(out[4]).startswith(b"event: response.output_text.delta\ndata: {")


def test_a_resume_is_the_same_events_after_its_number() -> None:
    whole = events(ResponseTurn(RID), TURN)
    for n in range(-1, len(whole)):
        assert events(ResponseTurn(RID, starting_after=n), TURN) == whole[n + 1 :]


def test_length_cancelled_error_and_lost_frames_end_it() -> None:
    head = TURN[:3]
    length = events(ResponseTurn(RID), [*head, frame(12, "done", finish_reason="length")])
    assert length[-1]["type"] == "response.incomplete"
    assert length[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    stopped = events(ResponseTurn(RID), [*head, frame(12, "done", finish_reason="cancelled")])
    assert stopped[-1]["type"] == "response.incomplete"
    assert stopped[-1]["response"]["status"] == "cancelled"
    rt = ResponseTurn(RID)
    failed = events(rt, [*head, frame(12, "error", "engine down", code="engine_error")])
    assert [e["type"] for e in failed[-2:]] == ["response.output_text.delta", "response.failed"]
    assert failed[-1]["sequence_number"] == 5
    assert failed[-1]["response"]["error"]["message"] == "engine down"
    assert rt.error_code == "engine_error"
    gap = Frame(session="s_1-x", turn=0, offset=11, kind="gap", text="frames 1..11 are gone")
    lost = events(ResponseTurn(RID), [gap, *TURN[2:]])
    assert [e["type"] for e in lost] == ["response.failed"]
    assert events(ResponseTurn(RID), [frame(5, "gap", turn=0), *TURN])[0]["sequence_number"] == 0


def test_the_body_is_checked_and_refused_by_name() -> None:
    def parse(body: object) -> Any:
        return parse_responses(body, model="m", default_max_tokens=64, max_tokens_limit=100,
                               max_chars=50)  # fmt: skip

    req = parse({"input": [{"role": "system", "content": "sys"},
                           {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
                 "metadata": {"a": "b"}, "background": True})  # fmt: skip
    assert req.messages == [{"role": "user", "content": "hi"}]
    assert req.instructions == "sys"
    assert req.max_tokens == 64
    assert req.params()["background"] is True
    cases: list[tuple[object, int, str | None]] = [
        ([], 400, None),
        ({"input": "x" * 51}, 400, "context_length_exceeded"),
        ({"input": "hi", "model": "gpt-5"}, 404, "model_not_found"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "unsupported_parameter"),
        ({"input": "hi", "reasoning": {"effort": "low"}}, 400, "unsupported_parameter"),
        ({"input": "hi", "max_output_tokens": 101}, 400, None),
        ({"input": "hi", "stream": "yes"}, 400, None),
        ({"input": [{"role": "assistant", "content": "a"}]}, 400, None),
        (
            {"input": "hi", "previous_response_id": "resp_a_1_1", "conversation": "conv_a"},
            400,
            None,
        ),
        ({"input": "hi", "metadata": {"k": "v" * 513}}, 400, None),
    ]
    for body, status, code in cases:
        with pytest.raises(WireError) as err:
            parse(body)
        assert err.value.status == status, body
        if code is not None:
            assert err.value.code == code, body
