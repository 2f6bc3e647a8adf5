"""The worker on engines that behave like real ones, not like the mock's defaults:
reports only in the last chunk, context limits, slow prefill."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import orjson
import pytest
from aiohttp import web
from redis.asyncio.cluster import RedisCluster

from devstack.mockengine.reply_length import ReplyLength
from tests.support.worker import Harness, wait_turn

pytestmark = pytest.mark.integration

LONG_REPLIES = ReplyLength(mean=80.0, max_tokens=120, min_tokens=60, sigma=0.0)


@pytest.mark.parametrize("report", ["last", "llamacpp"])
async def test_a_turn_cut_at_max_tokens_still_says_its_cache(
    h: Harness, redis: RedisCluster, report: str
) -> None:
    """A turn that reaches ``max_tokens`` on an engine that reports only at its end said
    cache "unknown" (the worker closed the stream before the report)."""
    await h.start_engines(1, report=report, reply=LONG_REPLIES)
    await h.start_worker()
    sid, token = await h.session()
    body = {"message": "tell me about caches", "system": "be brief " * 20, "max_tokens": 6}
    s1, b1, _ = await h.post_turn(sid, token, body)
    assert s1 == 202, b1
    d1 = (await wait_turn(redis, sid, b1["turn"]))[-1].meta
    assert d1 is not None
    assert d1["finish_reason"] == "length"
    assert (d1["cache"], d1["cached_tokens"]) == ("miss", 0)
    assert d1["prompt_tokens"] > 0
    s2, b2, _ = await h.post_turn(sid, token, {**body, "message": "and more"})
    assert s2 == 202, b2
    d2 = (await wait_turn(redis, sid, b2["turn"]))[-1].meta
    assert d2 is not None
    assert d2["cache"] == "hit"
    assert 0 < d2["cached_tokens"] < d2["prompt_tokens"]
    assert d2["computed_tokens"] == d2["prompt_tokens"] - d2["cached_tokens"]
    metrics = h.state.metrics.render().decode()
    assert f"tokenrelay_worker_cached_prompt_tokens_total {float(d2['cached_tokens'])}" in metrics


async def test_a_prompt_over_the_engine_context_is_prompt_too_long_with_its_reason(
    h: Harness, redis: RedisCluster
) -> None:
    """The screen read "engine answered HTTP 400"; the engine's reason stayed in the log."""
    await h.start_engines(1, n_ctx=40)
    await h.start_worker()
    sid, token = await h.session()
    s, b, _ = await h.post_turn(sid, token, {"message": "word " * 60})
    assert s == 202, b
    end = (await wait_turn(redis, sid, b["turn"]))[-1]
    assert end.kind == "error"
    assert end.meta is not None
    assert end.meta["code"] == "prompt_too_long"
    assert "exceeds the available context size (40 tokens)" in end.text
    assert "127.0.0.1" not in end.text


async def test_history_is_trimmed_to_the_context_the_engine_reports(
    h: Harness, redis: RedisCluster
) -> None:
    """A conversation that outgrew the context failed every later turn; now its oldest
    turns are left out (the engine's /props gives the context) and the meta says so."""
    await h.start_engines(1, report="llamacpp", n_ctx=400, reply=LONG_REPLIES)
    await h.start_worker()
    await _until(lambda: h.state.router.profiles.get("eng-0").context_tokens == 400)
    sid, token = await h.session()
    trimmed = []
    for i in range(6):
        s, b, _ = await h.post_turn(sid, token, {"message": f"turn {i} " + "word " * 40,
                                                 "max_tokens": 60})  # fmt: skip
        assert s == 202, b
        frames = await wait_turn(redis, sid, b["turn"])
        assert frames[-1].kind == "done", frames[-1]
        assert frames[0].meta is not None
        trimmed.append(frames[0].meta.get("trimmed_messages", 0))
        assert frames[-1].meta is not None
        assert frames[-1].meta["trimmed_messages"] == trimmed[-1]
    assert trimmed[0] == 0
    assert trimmed[-1] > 0
    assert h.state.router.profiles.get("eng-0").slots == 8  # its /props: total_slots


async def test_a_slow_engine_first_token_timeout_is_its_own_logged_and_aborts(
    h: Harness, redis: RedisCluster, caplog: pytest.LogCaptureFixture
) -> None:
    (eng,) = await h.start_engines(1, prefill_tok_per_s=20.0)
    await h.start_worker(
        first_token_timeout_s=60.0, engine_profiles=("eng-0=first_token_timeout:0.5",)
    )
    sid, token = await h.session()
    s, b, _ = await h.post_turn(sid, token, {"message": "word " * 100})
    assert s == 202, b
    end = (await wait_turn(redis, sid, b["turn"]))[-1]
    assert end.kind == "error"
    assert end.meta is not None
    assert end.meta["code"] == "timeout"
    assert "first_token timeout after 0.5s" in end.text
    await _until(lambda: eng.engine.gate.running == 0)  # the engine's request aborted
    assert any("first_token timeout" in r.getMessage() and "eng-0" in r.getMessage()
               for r in caplog.records)  # fmt: skip


async def _until(cond: Callable[[], bool], within_s: float = 5.0) -> None:
    async with asyncio.timeout(within_s):
        while not cond():
            await asyncio.sleep(0.02)


async def test_probes_do_not_interrupt_a_server_that_ends_a_stream_for_any_waiting_request(
    h: Harness, redis: RedisCluster
) -> None:
    """llama-cpp-python's server ends the reply it streams with ``[DONE]`` as soon as
    another request waits for its model lock (``interrupt_requests``, on by default), and
    its ``GET /v1/models`` takes that lock. The worker probed ``/v1/models`` (there is no
    ``/health``) every second: turns came back with 0 tokens and ``finish_reason: stop``."""
    waiting: list[str] = []
    words = [f"w{i} " for i in range(30)]

    async def models(request: web.Request) -> web.Response:
        waiting.append("models")
        await asyncio.sleep(0.05)
        waiting.remove("models")
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def chat(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for w in words:
            if waiting:  # interrupt_requests: another request waits for the model
                break
            obj = {"id": "c", "choices": [{"index": 0, "delta": {"content": w},
                                           "finish_reason": None}]}  # fmt: skip
            await resp.write(b"data: " + orjson.dumps(obj) + b"\n\n")
            await asyncio.sleep(0.05)
        else:
            obj = {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
            await resp.write(b"data: " + orjson.dumps(obj) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        await h.start_worker(engine_urls=(f"lcp={url}",), control_interval_s=0.1)
        sid, token = await h.session()
        s, b, _ = await h.post_turn(sid, token, {"message": "hello"})
        assert s == 202, b
        frames = await wait_turn(redis, sid, b["turn"])
        assert frames[-1].kind == "done"
        assert "".join(f.text for f in frames if f.kind == "token") == "".join(words)
        assert h.state.router.engines()[0].id == "lcp"  # alive all along: 404 on /health
    finally:
        await runner.cleanup()
