"""Tool calls through the worker's session fronts, against the mock engine (which answers
``tools`` with tool calls and, after a tool's result, with text: its text is a function
of the prompt, and it refuses a tool's result that answers no call of the messages
before it, so both say what the engine was sent).

- The Responses API takes function tools and streams ``function_call`` items with their
  arguments (the official ``openai`` SDK reassembles them); an agent continues with
  ``function_call_output`` items, by ``previous_response_id`` or by sending the whole
  conversation; a later turn's prompt, built from the stored history, carries the
  assistant's ``tool_calls`` and the tools' results; built-in tools are refused by name.
- The turns API and the AI SDK's chat POST forward tools to the engine (and refuse an
  unknown field by name); a reply of tool calls alone has a TTFT; an Idempotency-Key
  sent again with other options is a conflict.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from redis.asyncio.cluster import RedisCluster

from tests.support.worker import Harness, expected_reply, wait_turn

pytestmark = pytest.mark.integration

KEY = "gw-tools-turns-0123456789"
MODEL = "tokenrelay-mock"
ASK = "Weather in Oslo?"
TOOLS: list[Any] = [
    {"type": "function", "name": "weather", "parameters": {"type": "object"}},
    {"type": "function", "name": "clock", "parameters": {"type": "object"}},
]
CHAT_TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
MAX = 1024  # the worker's default max_tokens (the engines answer at most 48 tokens)


@pytest.fixture
async def gw(h: Harness) -> AsyncIterator[tuple[Harness, openai.AsyncOpenAI]]:
    await h.start_engines(1)
    await h.start_worker(cap=4, gateway_keys=(KEY,), admit_wait_s=0.2, default_max_tokens=MAX)
    client = openai.AsyncOpenAI(base_url=h.url("/v1"), api_key=KEY, max_retries=0)
    try:
        yield h, client
    finally:
        await client.close()


async def collect(stream: Any) -> list[Any]:
    """The events as the SDK parsed them (its accumulator, not the strict models: this
    SDK's model of ``function_call_arguments.done`` lacks the ``name`` OpenAI sends)."""
    return [ev async for ev in stream]


def _results(calls: list[Any]) -> list[Any]:
    return [
        {"type": "function_call_output", "call_id": c.call_id, "output": f'{{"n": {i}}}'}
        for i, c in enumerate(calls)
    ]


async def test_responses_function_tools_stream_calls_and_a_tools_result_continues(
    gw: tuple[Harness, openai.AsyncOpenAI],
) -> None:
    _, client = gw
    events = await collect(await client.responses.create(
        model=MODEL, input=ASK, tools=TOOLS, stream=True, parallel_tool_calls=True,
    ))  # fmt: skip
    done = events[-1]
    assert done.type == "response.completed"
    first = done.response
    calls = [o for o in first.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["weather", "clock"]
    for c in calls:
        assert json.loads(c.arguments) == {"query": ASK}
        deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
        assert "".join(e.delta for e in deltas if e.item_id == c.id) == c.arguments
    assert [getattr(t, "name", None) for t in first.tools] == ["weather", "clock"]
    # the agent ran the tools: their results continue the conversation
    after = await client.responses.create(
        model=MODEL, previous_response_id=first.id, input=_results(calls), tools=TOOLS
    )
    assert after.status == "completed"
    prompt: list[dict[str, str]] = [
        {"role": "user", "content": ASK}, {"role": "assistant", "content": ""},
        {"role": "tool", "content": '{"n": 0}'}, {"role": "tool", "content": '{"n": 1}'},
    ]  # fmt: skip
    assert after.output_text == expected_reply(prompt, MAX)  # the engine saw the results
    items = await client.responses.input_items.list(after.id)
    assert [(i.type, getattr(i, "call_id", None)) for i in items.data] == [
        ("function_call_output", c.call_id) for c in calls
    ]
    # a later turn's prompt is built from the stored history: calls and results in it
    # (else the engine would refuse the results, or answer another text)
    later = await client.responses.create(model=MODEL, previous_response_id=after.id,
                                          input="Thanks!")  # fmt: skip
    prompt += [{"role": "assistant", "content": after.output_text},
               {"role": "user", "content": "Thanks!"}]  # fmt: skip
    assert later.output_text == expected_reply(prompt, MAX)
    # an agent that sends the whole conversation itself (its earlier output passed back,
    # reasoning items included): the same prompt, the same reply
    passed_back = [o.model_dump(exclude_none=True) for o in first.output]
    whole = [{"role": "user", "content": ASK}, *passed_back, *_results(calls)]
    assert any(i["type"] == "reasoning" for i in whole[1:])
    again = await client.responses.create(model=MODEL, input=whole, tools=TOOLS)
    assert again.output_text == after.output_text


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"tools": [{"type": "web_search"}]}, "web_search"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "file_search"),
        ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "web_search_preview"),
        ({"tools": [{**TOOLS[0], "extra": 1}]}, "extra"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"temperature": "hot"}, "temperature"),
    ],
)
async def test_responses_refuse_built_in_tools_and_bad_options_by_name(
    gw: tuple[Harness, openai.AsyncOpenAI], extra: dict[str, Any], match: str
) -> None:
    _, client = gw
    with pytest.raises(openai.BadRequestError, match=match) as err:
        await client.responses.create(model=MODEL, input=ASK, extra_body=extra)
    assert err.value.status_code == 400


async def test_responses_refuse_a_result_for_a_call_never_made(
    gw: tuple[Harness, openai.AsyncOpenAI],
) -> None:
    """The engine is sent what the history holds: a result answering no call of it is
    the engine's refusal, not a silently rewritten prompt."""
    _, client = gw
    first = await client.responses.create(model=MODEL, input=ASK)  # text, no calls
    failed = await client.responses.create(
        model=MODEL, previous_response_id=first.id, stream=True,
        input=[{"type": "function_call_output", "call_id": "call_x", "output": "1"}],
    )  # fmt: skip
    events = await collect(failed)
    assert events[-1].type == "response.failed"


async def test_turns_forward_tools_and_a_reply_of_calls_alone_has_a_ttft(
    gw: tuple[Harness, openai.AsyncOpenAI], redis: RedisCluster
) -> None:
    h, _ = gw
    sid, token = await h.session()
    body = {"message": ASK, "tools": CHAT_TOOLS, "tool_choice": "auto", "seed": 3}
    status, started, _ = await h.post_turn(sid, token, body)
    assert status == 202, started
    frames = await wait_turn(redis, sid, started["turn"])
    parts = [(f.meta or {}).get("part") for f in frames if f.kind == "part"]
    assert "tool-call" in parts
    done = frames[-1].meta or {}
    assert done["finish_reason"] == "tool_calls"
    assert not [f for f in frames if f.kind == "token"]  # calls alone ...
    assert isinstance(done["ttft_ms"], float)  # ... and still a first token
    # refused by name: a field nobody reads, an option of the wrong type
    for bad, code in (({"functions": []}, "unsupported_parameter"),
                      ({"tools": "weather"}, "invalid_option")):  # fmt: skip
        status, out, _ = await h.post_turn(sid, token, {"message": "x", **bad})
        assert (status, out["error"]) == (400, code), out
        assert next(iter(bad)) in out["reason"]


async def test_an_idempotency_key_sent_again_with_other_options_is_a_conflict(
    gw: tuple[Harness, openai.AsyncOpenAI], redis: RedisCluster
) -> None:
    h, _ = gw
    sid, token = await h.session()
    key = {"Idempotency-Key": "tools-key-1"}
    body = {"message": "hello", "temperature": 0.2}
    status, first, _ = await h.post_turn(sid, token, body, headers=key)
    assert status == 202, first
    await wait_turn(redis, sid, first["turn"])
    status, same, headers = await h.post_turn(sid, token, body, headers=key)
    replayed = (status, same["turn"], headers.get("Idempotent-Replayed"))
    assert replayed == (202, first["turn"], "true")
    for other in ({**body, "temperature": 0.9}, {**body, "tools": CHAT_TOOLS}):
        status, out, _ = await h.post_turn(sid, token, other, headers=key)
        assert (status, out["error"]) == (422, "idempotency_key_reused"), out


async def test_the_ai_sdk_chat_forwards_tools_from_its_body(
    gw: tuple[Harness, openai.AsyncOpenAI],
) -> None:
    h, _ = gw
    sid, token = await h.session()
    assert h.http is not None
    user = {"id": "u-1", "role": "user", "parts": [{"type": "text", "text": ASK}]}
    auth = {"Authorization": f"Bearer {token}"}
    body = {"id": sid, "messages": [user], "trigger": "submit-message", "tools": CHAT_TOOLS}
    async with h.http.post(h.url("/v1/chat"), json=body, headers=auth) as r:
        assert r.status == 200
        chunks = [json.loads(line[6:]) for line in (await r.text()).splitlines()
                  if line.startswith("data: {")]  # fmt: skip
    kinds = [c["type"] for c in chunks]
    assert {"tool-input-start", "tool-input-available"} <= set(kinds)
    call = next(c for c in chunks if c["type"] == "tool-input-available")
    assert (call["toolName"], call["input"]) == ("weather", {"query": ASK})
    async with h.http.post(h.url("/v1/chat"), json={**body, "color": "red"}, headers=auth) as r:
        out = await r.json()
        assert (r.status, out["error"]) == (400, "unsupported_parameter")
        assert "color" in out["reason"]
    # the page ran the tool (addToolOutput) and sends its assistant message back: the
    # reply goes on after the output, which the engine gets after the stored call
    reply_id = next(c["messageId"] for c in chunks if c["type"] == "start")
    part = {"type": "tool-weather", "toolCallId": call["toolCallId"],
            "state": "output-available", "input": call["input"], "output": {"temp": 4}}  # fmt: skip
    ran = {"id": reply_id, "role": "assistant", "parts": [part]}
    after = {**body, "messages": [user, ran], "messageId": reply_id}
    async with h.http.post(h.url("/v1/chat"), json=after, headers=auth) as r:
        assert r.status == 200
        lines = (await r.text()).splitlines()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    text = "".join(c["delta"] for c in chunks if c["type"] == "text-delta")
    prompt = [{"role": "user", "content": ASK}, {"role": "assistant", "content": ""},
              {"role": "tool", "content": '{"temp": 4}'}]  # fmt: skip
    assert text == expected_reply(prompt, MAX)
    async with h.http.post(h.url("/v1/chat"), json=after, headers=auth) as r:
        out = await r.json()
        assert (r.status, out["error"]) == (400, "invalid_message")  # stored already
    # a page reloaded from the stored messages gets the output in its call's part
    url = h.url(f"/v1/sessions/{sid}/messages")
    async with h.http.get(url, headers=auth) as r:
        page = (await r.json())["messages"]
    async with h.http.get(url + "?format=ui", headers=auth) as r:
        ui = (await r.json())["messages"]
    assert [(m["role"], m.get("tool_call_id")) for m in page] == [
        ("user", None), ("assistant", None), ("tool", call["toolCallId"]), ("assistant", None),
    ]  # fmt: skip
    assert [m["role"] for m in ui] == ["user", "assistant", "assistant"]
    tool = next(p for p in ui[1]["parts"] if p["type"] == "tool-weather")
    assert (tool["state"], tool["output"]) == ("output-available", {"temp": 4})
    assert [p.get("text") for p in ui[2]["parts"] if p["type"] == "text"] == [text]


async def test_a_session_completion_continues_after_its_tools_and_the_next_turn_replays_them(
    gw: tuple[Harness, openai.AsyncOpenAI], redis: RedisCluster
) -> None:
    """Chat completions tied to a session: the tools' results end the messages (no user
    message after them), the turn stores them, and a turn of the turns API after it gets
    the whole exchange from the stored history."""
    h, _ = gw
    sid, token = await h.session()
    tied = openai.AsyncOpenAI(base_url=h.url("/v1"), api_key=token, max_retries=0,
                              default_headers={"X-Session-Id": sid})  # fmt: skip
    try:
        ask: list[Any] = [{"role": "user", "content": ASK}]
        first = await tied.chat.completions.create(model=MODEL, messages=ask, tools=CHAT_TOOLS)  # type: ignore[arg-type]
        msg = first.choices[0].message
        calls = msg.tool_calls or []
        assert [c.function.name for c in calls] == ["weather"]  # type: ignore[union-attr]
        results = [{"role": "tool", "tool_call_id": c.id, "content": "4"} for c in calls]
        convo = [*ask, msg.model_dump(exclude_none=True), *results]
        after = await tied.chat.completions.create(model=MODEL, messages=convo, tools=CHAT_TOOLS)  # type: ignore[arg-type]
        text = after.choices[0].message.content or ""
        prompt = [*ask, {"role": "assistant", "content": ""}, {"role": "tool", "content": "4"}]
        assert text == expected_reply(prompt, MAX)
    finally:
        await tied.close()
    # a regenerate of the turn that went on after the tools asks again with the results
    status, again, _ = await h.post_turn(sid, token, {"regenerate": True})
    assert status == 202, again
    frames = await wait_turn(redis, sid, again["turn"])
    text = "".join(f.text for f in frames if f.kind == "token")
    assert text == expected_reply(prompt, MAX, seed=again["turn"])
    status, started, _ = await h.post_turn(sid, token, {"message": "Thanks!"})
    assert status == 202, started
    frames = await wait_turn(redis, sid, started["turn"])
    assert frames[-1].kind == "done"
    reply = "".join(f.text for f in frames if f.kind == "token")
    prompt += [{"role": "assistant", "content": text}, {"role": "user", "content": "Thanks!"}]
    assert reply == expected_reply(prompt, MAX)


async def test_responses_text_format_reaches_the_engine_and_its_refusal_is_a_400(
    gw: tuple[Harness, openai.AsyncOpenAI], redis: RedisCluster
) -> None:
    """``text.format`` is the engine's ``response_format``, never dropped: the mock cannot
    take a JSON schema and says so, and the whole create answers that as OpenAI's 400
    (the engine's reason in it), not as a 503 to retry. A turn's error frame names it."""
    h, client = gw
    fmt = {"type": "json_schema", "name": "w", "schema": {"type": "object"}}
    with pytest.raises(openai.BadRequestError, match="response_format") as err:
        await client.responses.create(model=MODEL, input=ASK, extra_body={"text": {"format": fmt}})
    assert err.value.code == "engine_bad_request"
    plain = await client.responses.create(model=MODEL, input=ASK, text={"format": {"type": "text"}})
    assert plain.status == "completed"
    for text, param in (({"format": {"type": "xml"}}, "text.format"),
                        ({"verbosity": "low"}, "text")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as bad:
            await client.responses.create(model=MODEL, input=ASK, extra_body={"text": text})
        assert bad.value.code == "unsupported_parameter"
        assert param in str(bad.value)
    sid, token = await h.session()
    status, started, _ = await h.post_turn(sid, token, {"message": ASK, "logprobs": True})
    assert status == 202, started
    frames = await wait_turn(redis, sid, started["turn"])
    assert frames[-1].kind == "error"
    assert (frames[-1].meta or {})["code"] == "engine_refused"
    assert "logprobs" in frames[-1].text
