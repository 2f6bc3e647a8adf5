"""The OpenAI-compatible gateway, driven by the official ``openai`` SDK.

A worker in-process (tests/support/worker.py) on the real cluster with two mock engines;
the SDK talks to ``/v1`` as it would to OpenAI. Every test checks that the router holds
no lease afterwards and counted no double release.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from redis.asyncio.cluster import RedisCluster

from tests.support.worker import Harness, expected_reply, wait_turn
from worker.state import WorkerState

pytestmark = pytest.mark.integration

KEY = "gw-test-key-0123456789"
MODEL = "tokenrelay-mock"


@pytest.fixture
async def gw(h: Harness) -> AsyncIterator[tuple[Harness, openai.AsyncOpenAI]]:
    await h.start_engines(2)
    await h.start_worker(cap=4, gateway_keys=(KEY,), admit_wait_s=0.2)
    client = openai.AsyncOpenAI(base_url=h.url("/v1"), api_key=KEY, max_retries=0)
    try:
        yield h, client
    finally:
        await client.close()
    _assert_no_lease(h.state)


def _assert_no_lease(st: WorkerState) -> None:
    assert sum(st.router.in_flight().values()) == 0
    assert st.router._double_releases == 0


def _msgs(system: str, user: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def _plain(msgs: list[ChatCompletionMessageParam]) -> list[dict[str, str]]:
    return [{"role": str(m["role"]), "content": str(m.get("content", ""))} for m in msgs]


async def test_a_streamed_completion_is_the_engines_reply_with_usage(
    gw: tuple[Harness, openai.AsyncOpenAI],
) -> None:
    _, client = gw
    msgs = _msgs("You are terse.", "Tell me about tides.")
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        stream=True,
        max_tokens=20,
        stream_options={"include_usage": True},
    )
    text, finish, use = [], None, None
    async for ch in stream:
        if ch.usage is not None:
            use = ch.usage
        for c in ch.choices:
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(text) == expected_reply(_plain(msgs), 20)
    assert finish in ("stop", "length")
    assert use is not None
    assert use.completion_tokens > 0
    assert use.prompt_tokens > 0


async def test_a_whole_completion_and_the_model_list(
    gw: tuple[Harness, openai.AsyncOpenAI],
) -> None:
    _, client = gw
    msgs = _msgs("You are terse.", "Name three rivers.")
    r = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12)
    assert r.choices[0].message.content == expected_reply(_plain(msgs), 12)
    assert r.usage is not None
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_a_growing_conversation_stays_on_one_engine_and_hits_its_cache(
    gw: tuple[Harness, openai.AsyncOpenAI],
) -> None:
    """No session API: the routing key (system digest + the conversation's head) keeps
    every request of one conversation on the engine that holds its prefix."""
    _, client = gw
    msgs = _msgs("You are a hospital triage assistant. " * 20, "patient: headache since noon")
    engines, cached = [], []
    for i in range(4):
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=msgs,
            max_tokens=6,
        )
        engines.append(raw.headers["x-engine-id"])
        r = raw.parse()
        assert r.usage is not None
        details = r.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details is not None else None)
        msgs = [*msgs, {"role": "assistant", "content": r.choices[0].message.content or ""},
                {"role": "user", "content": f"and then {i}?"}]  # fmt: skip
    assert len(set(engines)) == 1, engines
    assert all(c is not None and c > 0 for c in cached[1:]), cached


async def test_refusals_are_openai_errors(gw: tuple[Harness, openai.AsyncOpenAI]) -> None:
    h, client = gw
    msgs = _msgs("s", "hi")
    bad = openai.AsyncOpenAI(base_url=h.url("/v1"), api_key="wrong-key-0123456789", max_retries=0)
    try:
        with pytest.raises(openai.AuthenticationError) as auth:
            await bad.chat.completions.create(model=MODEL, messages=msgs)
    finally:
        await bad.close()
    assert auth.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as nf:
        await client.chat.completions.create(model="gpt-5", messages=msgs)
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10**9)
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
        )
    assert h.http is not None
    async with h.http.post(h.url("/v1/chat/completions"), data=b"{not json",
                           headers={"Authorization": f"Bearer {KEY}"}) as r:  # fmt: skip
        assert r.status == 400
        assert (await r.json())["error"]["code"] == "malformed_json"


async def test_every_engine_full_is_a_429_with_retry_after(h: Harness) -> None:
    await h.start_engines(1, decode_tok_per_s=20.0)
    # no queue past the cap (cost_aware's): the refusal at the cap is the subject here
    await h.start_worker(cap=1, gateway_keys=(KEY,), admit_wait_s=0.1, route_queue=0.0)
    client = openai.AsyncOpenAI(base_url=h.url("/v1"), api_key=KEY, max_retries=0)
    try:
        slow = await client.chat.completions.create(
            model=MODEL,
            messages=_msgs("s", "a long answer please"),
            stream=True,
            max_tokens=40,
        )
        with pytest.raises(openai.RateLimitError) as full:
            await client.chat.completions.create(model=MODEL, messages=_msgs("s", "me too"))
        assert full.value.code == "engines_full"
        assert int(full.value.response.headers["retry-after"]) >= 1
        async for _ in slow:
            pass
    finally:
        await client.close()
    _assert_no_lease(h.state)


async def test_a_dead_engine_is_a_503_and_a_client_gone_mid_stream_frees_the_slot(
    gw: tuple[Harness, openai.AsyncOpenAI],
) -> None:
    h, client = gw
    msgs = _msgs("s", "stream something long")
    assert h.http is not None
    async with h.http.post(
        h.url("/v1/chat/completions"),
        json={"model": MODEL, "messages": msgs, "stream": True, "max_tokens": 40},
        headers={"Authorization": f"Bearer {KEY}"},
    ) as r:
        assert r.status == 200
        await r.content.readline()  # the first chunk: then the client leaves
    for _ in range(100):
        if sum(h.state.router.in_flight().values()) == 0:
            break
        await asyncio.sleep(0.02)
    for e in h.engines:
        await e.stop()
    with pytest.raises(openai.APIStatusError) as down:
        await client.chat.completions.create(model=MODEL, messages=msgs)
    assert down.value.status_code == 503
    assert "127.0.0.1" not in str(down.value.body)  # no internal address in the body


async def test_without_a_gateway_key_the_gateway_is_off_not_open(h: Harness) -> None:
    await h.start_engines(1)
    await h.start_worker()
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            h.url("/v1/chat/completions"), json={"model": MODEL, "messages": _msgs("s", "x")}
        ) as r,
    ):
        assert r.status == 401
        assert (await r.json())["error"]["code"] == "gateway_disabled"


async def test_a_completion_tied_to_a_session_streams_as_one_of_its_turns(
    gw: tuple[Harness, openai.AsyncOpenAI], redis: RedisCluster
) -> None:
    """``X-Session-Id`` (or ``user: session:<sid>``): the request runs as a turn of the
    session, so its other screens see it in the backlog, and its history grows."""
    h, _ = gw
    sid, token = await h.session()
    tied = openai.AsyncOpenAI(
        base_url=h.url("/v1"), api_key=token, max_retries=0,
        default_headers={"X-Session-Id": sid},
    )  # fmt: skip
    try:
        msgs = _msgs("You are terse.", "What is a shard?")
        stream = await tied.chat.completions.create(
            model=MODEL, messages=msgs, stream=True, max_tokens=16,
            stream_options={"include_usage": True},
        )  # fmt: skip
        text: list[str] = []
        use = None
        async for ch in stream:
            use = ch.usage or use
            text.extend(c.delta.content or "" for c in ch.choices)
        frames = await wait_turn(redis, sid, 1)
        assert frames[0].kind == "meta"
        assert frames[-1].kind == "done"
        backlog_text = "".join(f.text for f in frames if f.kind == "token")
        assert "".join(text) == backlog_text == expected_reply(_plain(msgs), 16)
        assert use is not None
        assert use.completion_tokens > 0
        # the same session named in `user`, with its write token, whole: the history grew
        by_user = openai.AsyncOpenAI(base_url=h.url("/v1"), api_key=token, max_retries=0)
        whole = await by_user.chat.completions.create(
            model=MODEL, messages=[*msgs, {"role": "assistant", "content": backlog_text},
                                   {"role": "user", "content": "And a slot?"}],
            max_tokens=8, user=f"session:{sid}",
        )  # fmt: skip
        assert whole.choices[0].message.content
        await by_user.close()
        # a gateway key never writes into a session, in either form
        _, keyed = gw
        with pytest.raises(openai.PermissionDeniedError) as denied:
            await keyed.chat.completions.create(
                model=MODEL, messages=msgs, max_tokens=8, user=f"session:{sid}"
            )
        assert denied.value.code == "session_token_required"
        hist = await h.state.turns.store.load(sid)
        assert [m["content"] for m in hist.messages if m["role"] == "user"] == [
            "What is a shard?",
            "And a slot?",
        ]
    finally:
        await tied.close()
    other_sid, _ = await h.session()
    wrong = openai.AsyncOpenAI(
        base_url=h.url("/v1"), api_key=token, max_retries=0,
        default_headers={"X-Session-Id": other_sid},
    )  # fmt: skip
    try:
        with pytest.raises(openai.PermissionDeniedError):
            await wrong.chat.completions.create(model=MODEL, messages=msgs)
    finally:
        await wrong.close()
