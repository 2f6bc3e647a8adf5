"""``pipe`` carries every part of a stream, once for every store: an OpenAI chat-completion
chunk stream (``reasoning_content``, parallel ``delta.tool_calls`` by index), a Responses
event stream (function-call items and argument deltas, reasoning and its summary, a URL
citation), and LangChain-style message chunks with tool-call chunks; built with the
``openai`` SDK's own types where it has them. The client's transcript rebuilds each
reply from the backlog, and the stored form (``GET .../messages``, ``format=ui``)
renders it."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from openai.types.chat import ChatCompletionChunk
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from relay.broker.base import Broker
from relay.client.core import Continuity
from relay.client.transcript import Transcript
from relay.producer import PartError, Producer, pipe
from relay.protocol.parts import ui_parts
from tests.contract.test_parts import backlog, roomy

__all__ = ["roomy"]  # the fixture, shared


async def _aiter(items: list[Any]) -> AsyncIterator[Any]:
    for x in items:
        yield x


def _chunk(delta: dict[str, Any], finish: str | None = None) -> ChatCompletionChunk:
    return ChatCompletionChunk.model_validate({
        "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    })  # fmt: skip


def _tc(index: int, *, cid: str | None = None, name: str | None = None,
        args: str | None = None) -> dict[str, Any]:  # fmt: skip
    fn: dict[str, Any] = {}
    if name is not None:
        fn["name"] = name
    if args is not None:
        fn["arguments"] = args
    d: dict[str, Any] = {"index": index, "function": fn}
    if cid is not None:
        d |= {"id": cid, "type": "function"}
    return d


async def _rebuild(edge: Broker, sid: str) -> Transcript:
    t, cont = Transcript(sid), Continuity(0)
    for f in await backlog(edge, sid):
        ok, problems = cont.accept(f)
        assert ok
        assert problems == []
        t.apply(f)
    assert t.refused == []
    return t


async def test_a_chat_completion_stream_with_reasoning_and_parallel_tool_calls(
    roomy: tuple[Producer, Broker],
) -> None:
    producer, edge = roomy
    s = producer.session("pp-" + secrets.token_hex(4))
    chunks = [
        _chunk({"role": "assistant", "reasoning_content": "The user wants "}),
        _chunk({"reasoning_content": "two cities."}),
        _chunk({"content": "Let me look."}),
        _chunk({"tool_calls": [_tc(0, cid="call_a", name="weather", args="")]}),
        _chunk({"tool_calls": [_tc(1, cid="call_b", name="weather", args='{"ci')]}),
        _chunk({"tool_calls": [_tc(0, args='{"city":"Oslo"}')]}),
        _chunk({"tool_calls": [_tc(1, args='ty":"Rome"}')]}),
        _chunk({"tool_calls": [_tc(2, cid="call_c", name="clock")]}),  # no arguments at all
        _chunk({}, finish="tool_calls"),
    ]
    await pipe(await s.start_turn("weather in Oslo and Rome?", watch=False), _aiter(chunks))
    t = await _rebuild(edge, s.id)
    reply = t.entries[-1]
    assert reply.text == "Let me look."
    assert reply.finish == "tool_calls"
    got = [(p.part, p.id, p.name, p.value() if p.part != "reasoning" else p.text)
           for p in reply.parts]  # fmt: skip
    assert got == [
        ("reasoning", "reasoning-1", "", "The user wants two cities."),
        ("tool-call", "call_a", "weather", {"city": "Oslo"}),
        ("tool-call", "call_b", "weather", {"city": "Rome"}),
        ("tool-call", "call_c", "clock", {}),
    ]
    stored = t.history()[-1]["parts"]
    assert [d["type"] for d in stored] == ["reasoning", "text", *["tool-call"] * 3]
    ui = ui_parts(stored)
    assert ui[0] == {"type": "reasoning", "id": "reasoning-1", "text": "The user wants two cities.",
                     "state": "done"}  # fmt: skip
    assert ui[2] == {"type": "tool-weather", "toolCallId": "call_a",
                     "state": "input-available", "input": {"city": "Oslo"}}  # fmt: skip


async def test_a_chat_stream_whose_tool_arguments_are_not_json_ends_with_error(
    roomy: tuple[Producer, Broker],
) -> None:
    producer, edge = roomy
    s = producer.session("pp-" + secrets.token_hex(4))
    chunks = [_chunk({"tool_calls": [_tc(0, cid="c", name="f", args='{"a": nope')]}),
              _chunk({}, finish="tool_calls")]  # fmt: skip
    with pytest.raises(PartError, match="not valid JSON"):
        await pipe(await s.start_turn("go", watch=False), _aiter(chunks))
    frames = await backlog(edge, s.id)
    assert frames[-1].kind == "error"
    assert "not valid JSON" in frames[-1].text
    t = await _rebuild(edge, s.id)
    assert (t.entries[-1].finish, t.entries[-1].parts[0].done) == ("error", False)


_EVENT = TypeAdapter(ResponseStreamEvent)


def _ev(d: dict[str, Any]) -> Any:
    return _EVENT.validate_python({"sequence_number": 0, **d})


async def test_a_responses_stream_with_function_calls_reasoning_and_a_citation(
    roomy: tuple[Producer, Broker],
) -> None:
    producer, edge = roomy
    s = producer.session("pp-" + secrets.token_hex(4))
    fc = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "search",
          "arguments": "", "status": "in_progress"}  # fmt: skip
    rs = {"type": "reasoning", "id": "rs_1", "summary": []}
    events = [
        _ev({"type": "response.output_item.added", "output_index": 0, "item": rs}),
        _ev({"type": "response.reasoning_summary_text.delta", "item_id": "rs_1",
             "output_index": 0, "summary_index": 0, "delta": "Searching first."}),
        _ev({"type": "response.reasoning_summary_text.done", "item_id": "rs_1",
             "output_index": 0, "summary_index": 0, "text": "Searching first."}),
        _ev({"type": "response.output_item.added", "output_index": 1, "item": fc}),
        _ev({"type": "response.function_call_arguments.delta", "item_id": "fc_1",
             "output_index": 1, "delta": '{"q":'}),
        _ev({"type": "response.function_call_arguments.delta", "item_id": "fc_1",
             "output_index": 1, "delta": '"tides"}'}),
        _ev({"type": "response.function_call_arguments.done", "item_id": "fc_1",
             "output_index": 1, "arguments": '{"q":"tides"}', "name": "search"}),
        _ev({"type": "response.output_text.delta", "item_id": "m", "output_index": 2,
             "content_index": 0, "delta": "Tides are", "logprobs": []}),
        _ev({"type": "response.output_text.annotation.added", "item_id": "m",
             "output_index": 2, "content_index": 0, "annotation_index": 0,
             "annotation": {"type": "url_citation", "url": "https://example.org/t",
                            "title": "Tides", "start_index": 0, "end_index": 5}}),
    ]  # fmt: skip
    await pipe(await s.start_turn("tides?", watch=False), _aiter(events))
    t = await _rebuild(edge, s.id)
    reply = t.entries[-1]
    assert reply.text == "Tides are"
    assert reply.finish == "tool_calls"
    got = [(p.part, p.id, p.name, p.summary, p.text) for p in reply.parts]
    assert got == [
        ("reasoning", "rs_1-summary-0", "", True, "Searching first."),
        ("tool-call", "call_1", "search", False, '{"q":"tides"}'),
        ("source", got[2][1], "", False, '{"url":"https://example.org/t","title":"Tides"}'),
    ]


async def test_langchain_message_chunks_with_tool_call_chunks(
    roomy: tuple[Producer, Broker],
) -> None:
    producer, edge = roomy
    s = producer.session("pp-" + secrets.token_hex(4))

    def chunk(content: Any = "", tcs: list[dict[str, Any]] | None = None,
              **extra: Any) -> SimpleNamespace:  # fmt: skip
        # the attributes of langchain_core's AIMessageChunk that the adapter reads
        return SimpleNamespace(content=content, tool_call_chunks=tcs or [],
                               additional_kwargs=extra, usage_metadata=None,
                               response_metadata={})  # fmt: skip

    items = [
        (chunk(reasoning_content="Think."), {"langgraph_node": "agent"}),  # LangGraph pairs
        (chunk([{"type": "text", "text": "Sure, "}]), {}),
        (chunk("calling."), {}),
        (chunk(tcs=[{"name": "lookup", "args": '{"id":', "id": "t1", "index": 0}]), {}),
        (chunk(tcs=[{"name": None, "args": " 7}", "id": None, "index": 0}]), {}),
    ]
    await pipe(await s.start_turn("look up 7", watch=False), _aiter(items))
    t = await _rebuild(edge, s.id)
    reply = t.entries[-1]
    assert reply.text == "Sure, calling."
    got = [(p.part, p.id, p.name, p.text, p.done) for p in reply.parts]
    assert got == [("reasoning", "reasoning-1", "", "Think.", True),
                   ("tool-call", "t1", "lookup", '{"id": 7}', True)]  # fmt: skip
