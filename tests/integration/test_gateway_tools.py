"""The chat-completions gateway carries tools, reasoning and every option to the engine,
driven by the official ``openai`` SDK against mock engines (which answer ``tools`` with
tool calls and reasoning, deterministically: devstack/mockengine/parts.py): the SDK
reassembles the streamed tool calls, a whole answer carries them, a tool's result in the
history reaches the engine, ``stop`` is honoured, and what the engine cannot do (or the
gateway does not know) is refused by name."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from redis.asyncio.cluster import RedisCluster

from relay.client.transcript import Transcript
from tests.support.worker import Harness, wait_turn

pytestmark = pytest.mark.integration

KEY = "gw-tools-key-0123456789"
MODEL = "tokenrelay-mock"
TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}},
]
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture
async def client(h: Harness) -> AsyncIterator[openai.AsyncOpenAI]:
    await h.start_engines(1)
    await h.start_worker(cap=4, gateway_keys=(KEY,), admit_wait_s=0.2)
    c = openai.AsyncOpenAI(base_url=h.url("/v1"), api_key=KEY, max_retries=0)
    try:
        yield c
    finally:
        await c.close()
    assert sum(h.state.router.in_flight().values()) == 0


async def test_streamed_tool_calls_and_reasoning_reassemble_in_the_sdk(
    client: openai.AsyncOpenAI,
) -> None:
    stream = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, stream=True, seed=7, temperature=0.2,
    )  # fmt: skip
    calls: dict[int, dict[str, str]] = {}
    reasoning, finish = "", None
    async for ch in stream:
        for c in ch.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            for tc in c.delta.tool_calls or ():
                call = calls.setdefault(tc.index, {"id": "", "name": "", "args": ""})
                call["id"] = tc.id or call["id"]
                if tc.function is not None:
                    call["name"] = tc.function.name or call["name"]
                    call["args"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert [c["name"] for c in calls.values()] == ["weather", "clock"]
    assert all(json.loads(c["args"]) == {"query": "Weather in Oslo?"} for c in calls.values())
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert reasoning == "The user asks: Weather in Oslo?. I will call weather, clock."


async def test_a_whole_answer_carries_the_calls_and_one_tool_when_not_parallel(
    client: openai.AsyncOpenAI,
) -> None:
    out = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, parallel_tool_calls=False,
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [  # type: ignore[union-attr]
        ("weather", {"query": "Weather in Oslo?"})
    ]
    named = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "clock"}},
    )  # fmt: skip
    assert [c.function.name for c in named.choices[0].message.tool_calls or []] == ["clock"]  # type: ignore[union-attr]


async def test_a_tools_result_in_the_history_reaches_the_engine(
    client: openai.AsyncOpenAI,
) -> None:
    first = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    msg = first.choices[0].message
    calls = msg.tool_calls or []
    history: list[Any] = [*ASK, msg.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": '{"temp": 4}'} for c in calls]
    after = await client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS)
    assert after.choices[0].finish_reason in ("stop", "length")
    assert after.choices[0].message.content  # text now: the engine saw the results
    # a result answering no call is refused by the engine: the history was kept as sent
    with pytest.raises(openai.BadRequestError, match="tool's result"):
        await client.chat.completions.create(
            model=MODEL, messages=[*ASK, {"role": "tool", "tool_call_id": "x", "content": "1"}],
        )  # fmt: skip


async def test_stop_is_honoured(client: openai.AsyncOpenAI) -> None:
    whole = await client.chat.completions.create(model=MODEL, messages=ASK)
    text = whole.choices[0].message.content or ""
    word = text.split()[2]
    cut = await client.chat.completions.create(model=MODEL, messages=ASK, stop=[word])
    assert cut.choices[0].message.content == text[: text.index(word)]
    assert cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logprobs": True, "top_logprobs": 2}, "logprobs"),  # the engine cannot
        ({"response_format": {"type": "json_object"}}, "response_format"),  # nor this
        ({"tool_choice": "sometimes"}, "tool_choice"),  # not a tool choice
        ({"functions": [{"name": "f"}]}, "functions"),  # never forwarded: refused by name
    ],
)
async def test_what_cannot_be_done_is_refused_by_name(
    client: openai.AsyncOpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=param):
        await client.chat.completions.create(model=MODEL, messages=ASK, extra_body=extra)


async def test_a_session_turn_with_tools_is_parts_in_the_backlog_and_the_history(
    client: openai.AsyncOpenAI, h: Harness, redis: RedisCluster
) -> None:
    """A completion tied to a session: the engine's reasoning and tool calls become the
    turn's parts (every screen of the session sees them), the SDK reassembles the same
    calls, and the stored messages (turns and ui) keep them."""
    sid, token = await h.session()
    tied = openai.AsyncOpenAI(base_url=h.url("/v1"), api_key=token, max_retries=0,
                              default_headers={"X-Session-Id": sid})  # fmt: skip
    try:
        stream = await tied.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, stream=True
        )
        calls: dict[int, dict[str, str]] = {}
        reasoning, finish = "", None
        async for ch in stream:
            for c in ch.choices:
                reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
                for tc in c.delta.tool_calls or ():
                    call = calls.setdefault(tc.index, {"id": "", "name": "", "args": ""})
                    call["id"] = tc.id or call["id"]
                    if tc.function is not None:
                        call["name"] = tc.function.name or call["name"]
                        call["args"] += tc.function.arguments or ""
                finish = c.finish_reason or finish
        assert finish == "tool_calls"
        frames = await wait_turn(redis, sid, 1)
        t = Transcript(sid)
        for f in frames:
            t.apply(f)
        reply = t.entries[-1]
        assert t.refused == []
        assert [(p.part, p.name) for p in reply.parts] == [
            ("reasoning", ""), ("tool-call", "weather"), ("tool-call", "clock"),
        ]  # fmt: skip
        assert reply.parts[0].text == reasoning
        assert [(p.id, p.text) for p in reply.parts[1:]] == [
            (c["id"], c["args"]) for c in calls.values()
        ]
        done = frames[-1].meta or {}
        assert (done["parts"], done["finish_reason"]) == (3, "tool_calls")
        assert isinstance(done["ttft_ms"], float)  # a reply of calls alone has a first token
        async with aiohttp.ClientSession() as http:
            auth = {"Authorization": f"Bearer {token}"}
            async with http.get(h.url(f"/v1/sessions/{sid}/messages"), headers=auth) as r:
                page = await r.json()
            async with http.get(h.url(f"/v1/sessions/{sid}/messages?format=ui"),
                                headers=auth) as r:  # fmt: skip
                ui = await r.json()
        assert page["messages"][-1]["parts"] == t.history()[-1]["parts"]
        assert [p["type"] for p in ui["messages"][-1]["parts"]] == [
            "reasoning", "tool-weather", "tool-clock",
        ]  # fmt: skip
    finally:
        await tied.close()
