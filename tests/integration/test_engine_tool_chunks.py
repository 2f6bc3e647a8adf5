"""The engine client on a real engine's tool-call stream: llama.cpp's ``llama-server``
(SmolLM2 with devstack/llama/smollm2-tools.jinja, ``tool_choice: "required"``), its SSE
bytes recorded verbatim (tests/support/recorded/llama-server-tool-call.sse). Its shape
differs from the mock engine's: the call's first delta carries the ``id``, ``type``,
``function.name`` and the first piece of the ``arguments`` (the mock's first has empty
arguments), the id has no ``call_`` prefix, the finish chunk is an empty delta with
``finish_reason: "tool_calls"``, and the usage and timings come in a last chunk with no
choices. The client hands the calls on as the engine sent them, the producer's chunk
parser (the one the worker's turns use) rebuilds the call from them, and a reply of
tool-call arguments is bounded like text (``max_tokens`` chunks, ``max_reply_bytes``)."""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from relay.broker.memstore import MemoryStore
from relay.client.transcript import Transcript
from relay.producer import ChatParts, Producer
from relay.protocol.frame import decode
from worker.engines.client import Delta, EngineClient

pytestmark = pytest.mark.integration

RECORDED = Path(__file__).parents[1] / "support" / "recorded" / "llama-server-tool-call.sse"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@contextlib.asynccontextmanager
async def engine(body: Any) -> AsyncIterator[str]:
    """A local engine answering every request with ``body``: bytes, or an async function
    writing the stream."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if isinstance(body, bytes):
            await resp.write(body)
        else:
            await body(resp)
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def collect(url: str, max_tokens: int, **kw: Any) -> list[Delta]:
    async with aiohttp.ClientSession() as http:
        c = EngineClient(http, connect_timeout_s=1, first_token_timeout_s=5, idle_timeout_s=5,
                         **kw)  # fmt: skip
        async with contextlib.aclosing(c.stream_chat(url, "smollm2", MESSAGES, max_tokens)) as s:
            return [d async for d in s]


async def test_llama_servers_tool_call_stream_is_read_whole() -> None:
    async with engine(RECORDED.read_bytes()) as url:
        deltas = await collect(url, 40)
    calls = [tc for d in deltas if d.extra for tc in d.extra["tool_calls"]]
    first = calls[0]
    assert (first["index"], first["type"]) == (0, "function")
    assert first["function"]["name"] == "get_weather"
    assert first["function"]["arguments"] == "{"  # the first piece comes with the name
    assert all(c["index"] == 0 and "id" not in c for c in calls[1:])
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris"}
    assert all(d.text == "" for d in deltas)
    assert deltas[0].meta is not None  # the first delta says the engine's meta
    end = deltas[-1]
    assert end.finish_reason == "tool_calls"
    assert end.usage is not None
    assert (end.usage.prompt_tokens, end.usage.completion_tokens) == (204, 31)
    # the turn's parts, as the worker's turn runner writes them
    store = MemoryStore()
    producer = Producer(store, keys="k" * 32)
    s = producer.session("tc-" + secrets.token_hex(4))
    turn = await s.start_turn("weather?", watch=False)
    parts = ChatParts(turn)
    for d in deltas:
        if d.extra:
            parts.feed(d.extra)
    parts.end()
    await turn.done(finish_reason=end.finish_reason)
    raw = await store.read_page(s.id, 0, 100, 0)
    t = Transcript(s.id)
    for f in raw.frames:
        t.apply(decode(f))
    assert t.refused == []
    [call] = t.entries[-1].parts
    assert (call.part, call.id, call.name) == ("tool-call", first["id"], "get_weather")
    assert call.value() == {"city": "Paris"}


def arg_chunk(piece: str) -> bytes:
    delta = {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
    return b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": delta}]}) + b"\n\n"


async def endless_call(resp: web.StreamResponse) -> None:
    """An engine that ignores ``max_tokens`` in a call's arguments: it never stops."""
    start = {"index": 0, "id": "c1", "type": "function",
             "function": {"name": "f", "arguments": '{"a": "'}}  # fmt: skip
    body = {"choices": [{"index": 0, "delta": {"tool_calls": [start]}}]}
    await resp.write(b"data: " + orjson.dumps(body) + b"\n\n")
    for _ in range(100_000):
        await resp.write(arg_chunk("x" * 64))


async def test_a_call_whose_arguments_never_end_is_bounded_like_text() -> None:
    """Before, only text chunks counted: an engine streaming a call's arguments past
    ``max_tokens`` (or past ``max_reply_bytes``) was read to its end, unbounded."""
    async with engine(endless_call) as url:
        by_tokens = await collect(url, 8, drain_chunks=4, drain_s=1.0)
        by_bytes = await collect(url, 100_000, max_reply_bytes=1000)
    assert sum(1 for d in by_tokens if d.extra) == 8
    assert by_tokens[-1].finish_reason == "length"
    args = "".join(tc["function"]["arguments"] for d in by_bytes if d.extra
                   for tc in d.extra["tool_calls"])  # fmt: skip
    assert len(args) <= 1000
    assert by_bytes[-1].finish_reason == "length"
