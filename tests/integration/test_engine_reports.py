"""The engine client reads an engine's report (usage, cached tokens, timings) wherever
the engine sends it, and reads on to the engine's own end after ``max_tokens``."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
import pytest
from aiohttp import web

from devstack.mockengine.reply_length import ReplyLength
from devstack.mockengine.server import RunningEngine
from tests.support import engines
from worker.engines.client import Delta, EngineClient

Handler = engines.Handler
SYSTEM = {"role": "system", "content": "Answer in one line. " * 12}
MESSAGES = [SYSTEM, {"role": "user", "content": "Tell me about prefix caches."}]


servers = pytest.fixture(engines.servers)
mock = pytest.fixture(engines.mock)
serve = pytest.fixture(engines.serve)
session = pytest.fixture(engines.session)
client = engines.client


async def collect(c: EngineClient, url: str, **kw: Any) -> list[Delta]:
    messages = kw.pop("messages", MESSAGES)
    async with contextlib.aclosing(c.stream_chat(url, "m", messages, **kw)) as s:
        return [d async for d in s]


def finished(eng: RunningEngine, reason: str) -> float:
    labels = {"engine": "e1", "model_name": eng.engine.cfg.model, "finished_reason": reason}
    value = eng.engine.metrics.registry.get_sample_value("vllm:request_success_total", labels)
    return value or 0.0


def sse(*objs: object) -> list[bytes]:
    return [b"data: " + (o if isinstance(o, bytes) else orjson.dumps(o)) + b"\n\n" for o in objs]


def chunk(content: str | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    delta = {} if content is None else {"content": content}
    return {"id": "c1", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


def handler(blocks: list[bytes], *, hold_s: float = 0.0) -> tuple[Handler, list[bool]]:
    """Writes ``blocks``; then holds the stream open ``hold_s`` (an engine that does not
    end); the list gets True when the client dropped the connection."""
    dropped: list[bool] = []

    async def h(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for b in blocks:
                await resp.write(b)
            end = asyncio.get_running_loop().time() + hold_s
            while asyncio.get_running_loop().time() < end:  # comments: a drop shows on write
                await resp.write(b": still here\n\n")
                await asyncio.sleep(0.05)
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            dropped.append(True)
            raise
        return resp

    return h, dropped


@pytest.mark.parametrize("report", ["last", "llamacpp"])
async def test_usage_only_in_the_last_chunk_is_read_after_max_tokens(mock, session, report) -> None:
    """The cut at ``max_tokens`` used to stop before the engine's usage chunk: every turn
    that reached its bound said cache "unknown" and the engine counted an abort."""
    eng = await mock(report=report, reply=ReplyLength(mean=60, min_tokens=40, sigma=0.0))
    c = client(session)
    first = await collect(c, eng.url, max_tokens=8)
    assert sum(1 for d in first if d.text) == 8
    assert first[-1].finish_reason == "length"
    usage = first[-1].usage
    assert usage is not None
    assert usage.cached_tokens == 0
    assert usage.prompt_tokens is not None
    assert usage.prompt_tokens > 0
    assert usage.completion_tokens == 8
    reply = "".join(d.text for d in first)
    follow = [
        *MESSAGES,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "More"},
    ]
    second = await collect(c, eng.url, messages=follow, max_tokens=8)
    usage2 = second[-1].usage
    assert usage2 is not None
    assert usage2.cached_tokens is not None
    assert usage2.cached_tokens >= 32  # the system prompt's blocks at least
    assert usage2.prompt_tokens is not None
    assert usage2.cached_tokens < usage2.prompt_tokens
    if report == "llamacpp":
        assert usage2.computed_tokens == usage2.prompt_tokens - usage2.cached_tokens
        assert usage2.prefill_s is not None
    assert finished(eng, "abort") == 0  # read to the engine's end: no aborts
    assert finished(eng, "length") == 2


async def test_an_engine_that_said_nothing_gives_no_usage(mock, session) -> None:
    eng = await mock(report="last")
    c = client(session, include_usage=False)
    deltas = await collect(c, eng.url, max_tokens=4)
    assert deltas[0].meta is not None
    assert deltas[0].meta.cached_tokens is None
    assert deltas[-1].usage is None


async def test_timings_and_usage_details_in_one_chunk(serve, session) -> None:
    timings = {"cache_n": 30, "prompt_n": 12, "prompt_ms": 150.0, "predicted_n": 2,
               "predicted_ms": 40.0}  # fmt: skip
    h, _ = handler(sse(chunk("a"), chunk("b"), chunk(None, "stop", timings=timings),
                       {"id": "c1", "choices": [], "timings": timings,
                        "usage": {"prompt_tokens": 42, "completion_tokens": 2,
                                  "prompt_tokens_details": {"cached_tokens": 30}}},
                       b"[DONE]"))  # fmt: skip
    deltas = await collect(client(session), await serve(h), max_tokens=16)
    usage = deltas[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.cached_tokens, usage.computed_tokens) == (42, 30, 12)
    assert (usage.prefill_s, usage.decode_s) == (0.15, 0.04)


async def test_an_engine_ignoring_max_tokens_is_cut_after_a_bounded_drain(serve, session) -> None:
    """Past ``max_tokens`` the client reads on for the report, but not for ever: an engine
    that goes on generating is cut after ``drain_chunks`` chunks, its text never reaches
    the caller."""
    h, dropped = handler(sse(*[chunk(f"t{i} ") for i in range(200)]), hold_s=30)
    c = client(session, drain_chunks=5, drain_s=5.0)
    deltas = await collect(c, await serve(h), max_tokens=3)
    assert "".join(d.text for d in deltas) == "t0 t1 t2 "
    assert deltas[-1].finish_reason == "length"
    async with asyncio.timeout(2):
        while not dropped:
            await asyncio.sleep(0.01)


async def test_a_silent_engine_is_cut_after_the_drain_time(serve, session) -> None:
    h, dropped = handler(sse(chunk("a"), chunk("b")), hold_s=30)
    c = client(session, drain_s=0.3)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    deltas = await collect(c, await serve(h), max_tokens=2)
    assert [d.text for d in deltas] == ["a", "b", ""]
    assert deltas[-1].finish_reason == "length"
    assert loop.time() - t0 < 3.0  # the drain's bound, far under the idle timeout (5 s)
    async with asyncio.timeout(2):
        while not dropped:
            await asyncio.sleep(0.01)
