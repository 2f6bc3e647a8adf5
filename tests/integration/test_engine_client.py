"""The engine client against the mock engine and against misbehaving servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from aiohttp import web

from devstack.mockengine.server import RunningEngine
from tests.support import engines
from worker.engines.client import Delta, EngineClient, chat_completions_url
from worker.engines.errors import (
    EngineError,
    EngineHTTPError,
    EngineProtocolError,
    EngineStreamError,
    EngineTimeout,
    EngineUnavailable,
)

Handler = engines.Handler
MESSAGES = [{"role": "user", "content": "Tell me about prefix caches."}]


servers = pytest.fixture(engines.servers)
mock = pytest.fixture(engines.mock)
serve = pytest.fixture(engines.serve)
session = pytest.fixture(engines.session)
client = engines.client


async def collect(c: EngineClient, url: str, **kw: Any) -> list[Delta]:
    messages = kw.pop("messages", MESSAGES)
    async with contextlib.aclosing(c.stream_chat(url, "m", messages, **kw)) as s:
        return [d async for d in s]


async def drain(c: EngineClient, url: str) -> tuple[list[Delta], EngineError]:
    """The deltas received before the stream failed, and the error."""
    got: list[Delta] = []
    try:
        async for d in c.stream_chat(url, "m", MESSAGES):
            got.append(d)
    except EngineError as exc:
        return got, exc
    raise AssertionError("the stream did not fail")


async def until(cond: Callable[[], bool], within_s: float = 2.0) -> None:
    async with asyncio.timeout(within_s):
        while not cond():
            await asyncio.sleep(0.01)


def aborted(eng: RunningEngine) -> float | None:
    labels = {"engine": "e1", "model_name": eng.engine.cfg.model}
    name = "tokenrelay_engine_aborted_requests_total"
    return eng.engine.metrics.registry.get_sample_value(name, labels)


def sse_handler(*blocks: bytes, pause_s: float = 0.0, status: int = 200) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=status, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for b in blocks:
            await resp.write(b)
            if pause_s:
                await asyncio.sleep(pause_s)
        await resp.write_eof()
        return resp

    return handler


def chunk(content: str | None = None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    obj = {"id": "c1", "object": "chat.completion.chunk", "choices": [choice]}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def test_engine_url_forms_map_to_the_chat_endpoint() -> None:
    full = "http://h:1/v1/chat/completions"
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", full):
        assert chat_completions_url(url) == full


async def test_streams_the_mock_reply_with_meta_first_and_finish_last(mock, session) -> None:
    eng = await mock()
    deltas = await collect(client(session), eng.url, max_tokens=1000)
    assert len(deltas) >= 2
    assert deltas[0].meta is not None
    assert deltas[0].meta.engine_id == "e1"
    assert deltas[0].meta.cached_tokens == 0
    assert deltas[0].meta.response_id is not None
    assert all(d.meta is None for d in deltas[1:])
    assert all(d.finish_reason is None and d.text for d in deltas[:-1])
    last = deltas[-1]
    assert (last.text, last.finish_reason) == ("", "stop")
    assert last.usage is not None
    assert last.usage.completion_tokens == len(deltas) - 1
    assert last.usage.cached_tokens == 0
    text = "".join(d.text for d in deltas)
    body = {"messages": MESSAGES, "max_tokens": 1000}
    async with session.post(f"{eng.url}/v1/chat/completions", json=body) as resp:
        assert text == (await resp.json())["choices"][0]["message"]["content"]


async def test_second_turn_reports_cached_tokens(mock, session) -> None:
    eng = await mock()
    c = client(session)
    turn1 = [{"role": "system", "content": "Be brief. " * 20}, *MESSAGES]
    reply = "".join(d.text for d in await collect(c, eng.url, messages=turn1))
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "Go on"}]
    deltas = await collect(c, eng.url, messages=turn2)
    assert deltas[0].meta is not None
    assert deltas[0].meta.cached_tokens is not None
    assert deltas[0].meta.cached_tokens >= 48
    assert deltas[-1].usage is not None
    assert deltas[-1].usage.cached_tokens == deltas[0].meta.cached_tokens


async def test_leaving_the_stream_early_aborts_the_engine_request(mock, session) -> None:
    eng = await mock(decode_tok_per_s=20.0)
    async with contextlib.aclosing(client(session).stream_chat(eng.url, "m", MESSAGES)) as s:
        async for _ in s:
            assert eng.engine.gate.running == 1
            break
    await until(lambda: eng.engine.gate.running == 0, within_s=1.0)
    assert aborted(eng) == 1


async def test_cancelling_the_consumer_task_aborts_the_engine_request(mock, session) -> None:
    eng = await mock(decode_tok_per_s=20.0)
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in client(session).stream_chat(eng.url, "m", MESSAGES):
            first.set()

    task = asyncio.create_task(consume())
    await first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: eng.engine.gate.running == 0, within_s=1.0)
    assert aborted(eng) == 1


async def test_dropping_an_unfinished_stream_aborts_the_engine_request(mock, session) -> None:
    eng = await mock(decode_tok_per_s=20.0)
    stream = client(session).stream_chat(eng.url, "m", MESSAGES)
    await anext(stream)
    del stream  # the event loop's async-generator finaliser closes it
    await until(lambda: eng.engine.gate.running == 0)


async def test_connection_refused_is_engine_unavailable(session) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(EngineUnavailable) as info:
        await collect(client(session), f"http://127.0.0.1:{port}")
    assert info.value.mid_stream is False
    assert info.value.engine_url is not None


async def test_slow_prefill_is_a_first_token_timeout_and_aborts(mock, session) -> None:
    eng = await mock(prefill_tok_per_s=10.0)  # ~1 s of prefill
    with pytest.raises(EngineTimeout) as info:
        await collect(client(session, first_token_timeout_s=0.2), eng.url)
    assert info.value.phase == "first_token"
    await until(lambda: eng.engine.gate.running == 0, within_s=1.0)


async def test_no_response_headers_is_a_first_token_timeout(serve, session) -> None:
    async def never(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(10)
        raise AssertionError("unreachable")

    url = await serve(never)
    with pytest.raises(EngineTimeout) as info:
        await collect(client(session, first_token_timeout_s=0.2), url)
    assert info.value.phase == "first_token"


async def test_stalled_stream_is_an_idle_timeout(mock, session) -> None:
    eng = await mock(decode_tok_per_s=2.0)
    got, exc = await drain(client(session, idle_timeout_s=0.1), eng.url)
    assert isinstance(exc, EngineTimeout)
    assert exc.phase == "idle"
    assert len(got) == 1
    await until(lambda: eng.engine.gate.running == 0, within_s=1.0)


async def test_http_400_carries_status_and_the_engine_message(mock, session) -> None:
    eng = await mock()
    with pytest.raises(EngineHTTPError) as info:
        await collect(client(session), eng.url, max_tokens=0)
    assert info.value.status == 400
    assert "max_tokens" in info.value.message
    assert info.value.retryable is False
    assert '"error"' in info.value.body


async def test_503_with_retry_after_is_retryable(serve, session) -> None:
    async def busy(request: web.Request) -> web.Response:
        return web.Response(status=503, text="overloaded", headers={"Retry-After": "2"})

    with pytest.raises(EngineHTTPError) as info:
        await collect(client(session), await serve(busy))
    assert (info.value.status, info.value.retry_after_s) == (503, 2.0)
    assert info.value.retryable
    assert "overloaded" in info.value.message


async def test_error_object_inside_the_stream_is_an_engine_stream_error(serve, session) -> None:
    err = b'data: {"error": {"object": "error", "message": "KV cache full", "code": 507}}\n\n'
    url = await serve(sse_handler(chunk("Hi"), err, b"data: [DONE]\n\n"))
    got, exc = await drain(client(session), url)
    assert [d.text for d in got] == ["Hi"]
    assert isinstance(exc, EngineStreamError)
    assert isinstance(exc, EngineHTTPError)
    assert exc.status == 507
    assert exc.message == "KV cache full"


@pytest.mark.parametrize(
    "blocks",
    [
        (b"data: {not json}\n\n",),
        (b"data: [1, 2]\n\n",),
        (b'data: {"choices": "nope"}\n\n',),
        (chunk("Hello"),),  # clean end of body without finish_reason or [DONE]
    ],
)
async def test_malformed_streams_are_protocol_errors(serve, session, blocks) -> None:
    with pytest.raises(EngineProtocolError):
        await collect(client(session), await serve(sse_handler(*blocks)))


async def test_connection_lost_mid_stream_is_unavailable(serve, session) -> None:
    async def dies(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk("Hel"))
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()
        return resp

    got, exc = await drain(client(session), await serve(dies))
    assert isinstance(exc, EngineUnavailable)
    assert exc.mid_stream
    assert [d.text for d in got] == ["Hel"]


async def test_fragmented_sse_with_comments_crlf_and_no_space_parses(serve, session) -> None:
    raw = (
        b": hello\r\n\r\n"
        + chunk("Grü").replace(b"data: ", b"data:").replace(b"\n", b"\r\n")
        + b": keep-alive\n\n"
        + chunk("ße")
        + chunk(None, "length")
        + b"data:[DONE]"
    )
    pieces = [raw[i : i + 3] for i in range(0, len(raw), 3)]
    url = await serve(sse_handler(*pieces, pause_s=0.001))
    deltas = await collect(client(session), url)
    assert [(d.text, d.finish_reason) for d in deltas] == [
        ("Grü", None),
        ("ße", None),
        ("", "length"),
    ]


async def test_done_without_finish_reason_means_stop(serve, session) -> None:
    url = await serve(sse_handler(chunk("ok"), b"data: [DONE]\n\n"))
    deltas = await collect(client(session), url)
    assert [(d.text, d.finish_reason) for d in deltas] == [("ok", None), ("", "stop")]


async def test_a_json_answer_to_a_stream_request_is_accepted(serve, session) -> None:
    async def whole(request: web.Request) -> web.Response:
        message = {"role": "assistant", "content": "Whole."}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        usage = {"prompt_tokens": 3, "completion_tokens": 2}
        body = {"id": "x", "object": "chat.completion", "choices": [choice], "usage": usage}
        return web.json_response(body, headers={"x-engine-id": "ollama-1"})

    deltas = await collect(client(session), await serve(whole))
    assert [(d.text, d.finish_reason) for d in deltas] == [("Whole.", None), ("", "stop")]
    assert deltas[0].meta is not None
    assert deltas[0].meta.engine_id == "ollama-1"
    assert deltas[1].usage is not None
    assert deltas[1].usage.completion_tokens == 2


async def test_every_failure_is_an_engine_error(serve, session) -> None:
    async def teapot(request: web.Request) -> web.Response:
        return web.Response(status=418)

    with pytest.raises(EngineError):
        await collect(client(session), await serve(teapot))
