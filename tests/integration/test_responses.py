"""OpenAI's Responses API on the worker, driven by the official ``openai`` SDK.

A worker in-process (tests/support/worker.py) on the real cluster with mock engines;
the SDK talks to ``/v1`` as it would to OpenAI. Every streamed event is validated by the
SDK's own typed models (pydantic, strictly: a missing field fails) and must carry no
field those models do not know. The resume across relays is in
tests/e2e/test_responses_resume.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from relay.broker.rediscluster.publisher import read_backlog
from relay.fronts.responses.wire import parse_response_id
from relay.protocol.frame import decode
from relay.service import cors
from tests.support.worker import Harness, expected_reply

pytestmark = pytest.mark.integration

KEY = "gw-test-key-0123456789"
MODEL = "tokenrelay-mock"
_EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def no_unknown_fields(model: BaseModel, where: str = "") -> None:
    """Fail on any field the SDK's model does not declare (its ``model_extra``)."""
    extra = model.model_extra or {}
    assert not extra, f"{where or type(model).__name__}: unknown fields {sorted(extra)}"
    for name in type(model).model_fields:
        value = getattr(model, name)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, BaseModel):
                no_unknown_fields(v, f"{where}.{name}")


def typed(event: Any) -> Any:
    """The SDK's event, validated again strictly by its own models (a missing or
    mistyped field raises) and checked for unknown fields."""
    again = _EVENTS.validate_python(event.to_dict())
    assert type(again) is type(event)
    no_unknown_fields(again, event.type)
    return again


@pytest.fixture
async def gw(h: Harness) -> AsyncIterator[tuple[Harness, openai.AsyncOpenAI]]:
    await h.start_engines(2)
    await h.start_worker(cap=4, gateway_keys=(KEY,), admit_wait_s=0.2)
    client = openai.AsyncOpenAI(base_url=h.url("/v1"), api_key=KEY, max_retries=0)
    try:
        yield h, client
    finally:
        await client.close()


async def collect(stream: Any) -> list[Any]:
    return [typed(ev) async for ev in stream]


def text_of(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


async def test_a_whole_response_is_the_engines_reply_with_usage(
    gw: tuple[Harness, openai.AsyncOpenAI],
) -> None:
    _, client = gw
    r = await client.responses.create(
        model=MODEL, input="Tell me about tides.", instructions="You are terse.",
        max_output_tokens=20, metadata={"case": "whole"},
    )  # fmt: skip
    no_unknown_fields(Response.model_validate(r.to_dict()))
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Tell me about tides."}]  # fmt: skip
    assert r.output_text == expected_reply(msgs, 20)
    assert r.status in ("completed", "incomplete")
    assert r.metadata == {"case": "whole"}
    assert r.instructions == "You are terse."
    assert r.max_output_tokens == 20
    assert r.usage is not None
    assert r.usage.output_tokens > 0
    assert r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    again = await client.responses.retrieve(r.id)
    assert again.output_text == r.output_text
    assert again.status == r.status
    items = await client.responses.input_items.list(r.id)
    assert [i.model_dump()["content"][0]["text"] for i in items.data] == ["Tell me about tides."]


async def test_a_streamed_response_is_every_event_in_order(
    gw: tuple[Harness, openai.AsyncOpenAI],
) -> None:
    _, client = gw
    stream = await client.responses.create(model=MODEL, input="Name three rivers.", stream=True,
                                           max_output_tokens=30)  # fmt: skip
    events = await collect(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]  # fmt: skip
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = text_of(events)
    assert text == expected_reply([{"role": "user", "content": "Name three rivers."}], 30)
    assert events[-4].text == text
    final = events[-1].response
    assert final.output_text == text
    assert final.usage is not None
    assert final.usage.output_tokens > 0
    # the same events again, from the backlog, and from any point on
    rid = final.id
    replay = await collect(await client.responses.retrieve(rid, stream=True))
    assert [e.to_dict() for e in replay] == [e.to_dict() for e in events]
    tail = await collect(await client.responses.retrieve(rid, stream=True, starting_after=5))
    assert [e.to_dict() for e in tail] == [e.to_dict() for e in events[6:]]


async def test_a_worker_serves_a_resumed_stream_to_another_origin_as_a_relay_does(
    gw: tuple[Harness, openai.AsyncOpenAI],
) -> None:
    """A door that routes by path only (a Kubernetes Ingress) sends a cross-origin
    resume, its preflight and its GET, to a worker: both answer as a relay's would."""
    h, client = gw
    done = await client.responses.create(model=MODEL, input="Name a sea.", max_output_tokens=8)
    assert h.http is not None
    url = h.url(f"/v1/responses/{done.id}?stream=true")
    asked = {"Origin": "https://app.example", "Access-Control-Request-Method": "GET",
             "Access-Control-Request-Headers": "authorization"}  # fmt: skip
    async with h.http.options(url, headers=asked) as r:
        assert r.status == 204
        for name, value in cors.PREFLIGHT.items():
            assert r.headers[name] == value, name
        assert r.headers["Access-Control-Allow-Origin"] == "*"
    headers = {"Origin": "https://app.example", "Authorization": f"Bearer {KEY}"}
    async with h.http.get(url, headers=headers) as r:
        assert r.status == 200
        assert r.content_type == "text/event-stream"
        assert r.headers["Access-Control-Allow-Origin"] == "*"
        assert (await r.read()).startswith(b"event: response.created\n")


async def test_background_and_stream_resumes_where_it_left_off(h: Harness) -> None:
    await h.start_engines(1, decode_tok_per_s=60.0)
    await h.start_worker(cap=4, gateway_keys=(KEY,))
    async with openai.AsyncOpenAI(base_url=h.url("/v1"), api_key=KEY, max_retries=0) as client:
        stream = await client.responses.create(model=MODEL, input="a long story", stream=True,
                                               background=True, max_output_tokens=40)  # fmt: skip
        first: list[Any] = []
        async for ev in stream:
            first.append(typed(ev))
            if len(first) == 7:
                break
        await stream.close()  # the client drops: a background response runs on
        rid = first[0].response.id
        assert first[0].response.background is True
        running = await client.responses.retrieve(rid)
        assert running.status == "in_progress"
        rest = await collect(await client.responses.retrieve(rid, stream=True, starting_after=6))
        events = first + rest
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].type in ("response.completed", "response.incomplete")
        done = await client.responses.retrieve(rid)
        assert done.output_text == text_of(events)
        assert done.output_text == expected_reply([{"role": "user", "content": "a long story"}],
                                                  40)  # fmt: skip


async def test_a_background_response_is_cancelled_by_any_worker(h: Harness) -> None:
    await h.start_engines(1, decode_tok_per_s=20.0)
    await h.start_worker(cap=4, gateway_keys=(KEY,))
    async with openai.AsyncOpenAI(base_url=h.url("/v1"), api_key=KEY, max_retries=0) as client:
        r = await client.responses.create(model=MODEL, input="go on and on", background=True,
                                          max_output_tokens=200)  # fmt: skip
        assert r.status == "in_progress"
        assert r.background is True
        await asyncio.sleep(0.3)
        c = await client.responses.cancel(r.id)
        assert c.status == "cancelled"
        assert c.id == r.id
        later = await client.responses.retrieve(r.id)
        assert later.status == "cancelled"
        assert later.output_text == c.output_text
        events = await collect(await client.responses.retrieve(r.id, stream=True))
        assert events[-1].type == "response.incomplete"
        assert events[-1].response.status == "cancelled"


async def test_a_chain_of_five_stays_on_one_engine_and_one_session(
    gw: tuple[Harness, openai.AsyncOpenAI],
) -> None:
    h, client = gw
    prev: str | None = None
    ids = []
    for i in range(5):
        r = await client.responses.create(
            model=MODEL, input=f"step {i}: what next?", max_output_tokens=8,
            instructions="You are a planner. " * 30, previous_response_id=prev,
        )  # fmt: skip
        assert r.previous_response_id == prev
        ids.append(r.id)
        prev = r.id
    sids = {parse_response_id(i).session for i in ids}
    assert len(sids) == 1
    (sid,) = sids
    assert [parse_response_id(i).turn for i in ids] == [1, 2, 3, 4, 5]
    raw, _, _ = await read_backlog(h.redis, sid, 0, 10_000)
    engines = [f.meta["engine"] for f in map(decode, raw) if f.kind == "meta" and f.meta]
    assert len(engines) == 5, engines
    assert len(set(engines)) == 1, engines
    # the conversation is the session: a `conversation` continues it too
    assert r.conversation is not None
    nxt = await client.responses.create(model=MODEL, input="and last?",
                                        conversation=r.conversation.id)  # fmt: skip
    assert parse_response_id(nxt.id).session == sid
    deleted = await client.responses.with_raw_response.delete(nxt.id)
    assert deleted.status_code == 200
    assert deleted.http_response.json() == {"id": nxt.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(ids[0])


async def test_refusals_are_the_sdks_exception_classes(h: Harness) -> None:
    await h.start_engines(1, decode_tok_per_s=20.0)
    await h.start_worker(cap=1, gateway_keys=(KEY,), admit_wait_s=0.1, route_queue=0.0,
                         max_message_chars=2000)  # fmt: skip
    base = h.url("/v1")
    async with (
        openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as client,
        openai.AsyncOpenAI(base_url=base, api_key="wrong-key-0123456789", max_retries=0) as bad,
    ):
        with pytest.raises(openai.AuthenticationError) as auth:
            await bad.responses.create(model=MODEL, input="hi")
        assert auth.value.code == "invalid_api_key"
        with pytest.raises(openai.NotFoundError) as nf:
            await client.responses.retrieve("resp_nosuchsession_1_1")
        assert nf.value.code == "response_not_found"
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve("not-an-id")
        with pytest.raises(openai.BadRequestError) as big:
            await client.responses.create(model=MODEL, input="x" * 2001)
        assert big.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError):
            await client.responses.create(model=MODEL, input=[])
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model=MODEL, input="hi",
                                          previous_response_id="resp_elsewhere_1_1")  # fmt: skip
        slow = await client.responses.create(model=MODEL, input="a long one", background=True,
                                             max_output_tokens=60)  # fmt: skip
        with pytest.raises(openai.RateLimitError) as full:
            await client.responses.create(model=MODEL, input="me too")
        assert full.value.code == "engines_full"
        assert int(full.value.response.headers["retry-after"]) >= 1
        await client.responses.cancel(slow.id)
        for e in h.engines:
            await e.stop()
        with pytest.raises(openai.InternalServerError) as down:
            await client.responses.create(model=MODEL, input="anyone there?")
        assert down.value.status_code == 503
        assert "127.0.0.1" not in str(down.value.body)


async def test_a_session_of_the_session_api_is_not_a_response(
    gw: tuple[Harness, openai.AsyncOpenAI],
) -> None:
    """A gateway key reads and writes only the sessions the Responses API created."""
    h, client = gw
    sid, token = await h.session()
    status, body, _ = await h.post_turn(sid, token, {"message": "hello"})
    assert status == 202, body
    rid = f"resp_{sid}_{body['turn']}_{body['offset']}"
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(rid)
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model=MODEL, input="hi", previous_response_id=rid)
