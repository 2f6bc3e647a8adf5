"""The mock engine over real HTTP on 127.0.0.1: wire format, prefix cache, queueing, aborts."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from devstack.mockengine import prefix_cache as pc
from devstack.mockengine.reply_length import ReplyLength
from devstack.mockengine.server import EngineConfig, RunningEngine, start_engine
from devstack.procs import Proc, log_line

StartEngine = Callable[..., Awaitable[RunningEngine]]

FAST: dict[str, Any] = {"prefill_tok_per_s": 0.0, "decode_tok_per_s": 0.0}


@pytest.fixture
async def start() -> AsyncIterator[StartEngine]:
    started: list[RunningEngine] = []

    async def _start(**kw: Any) -> RunningEngine:
        kw.setdefault("engine_id", f"mock-{len(started)}")
        eng = await start_engine(EngineConfig(port=0, **kw))
        started.append(eng)
        return eng

    yield _start
    for eng in started:
        await eng.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def chat(content: str, **kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **kw}


async def read_events(resp: aiohttp.ClientResponse) -> list[str]:
    body = (await resp.read()).decode()
    assert body.endswith("\n\n")
    return [block.removeprefix("data: ") for block in body.strip().split("\n\n")]


async def stream(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    async with http.post(
        f"{url}/v1/chat/completions", json={**body, "stream": True}, headers=headers
    ) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await read_events(resp)
        chunks = [json.loads(e) for e in events[:-1]]
        return {"headers": resp.headers, "events": events, "chunks": chunks}


def reply_text(result: dict[str, Any]) -> str:
    return "".join(
        c["choices"][0]["delta"].get("content", "") for c in result["chunks"] if c["choices"]
    )


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            return float(m.group(2))
    raise AssertionError(f"{name} not in metrics")


async def metrics(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


async def until(cond: Callable[[], bool], within_s: float = 5.0) -> None:
    """Poll a condition on engine state (there is no event to wait on from outside)."""
    async with asyncio.timeout(within_s):
        while not cond():
            await asyncio.sleep(0.01)


async def test_stream_uses_the_exact_openai_chunk_format(start: StartEngine, http) -> None:
    eng = await start(**FAST)
    body = chat("hello there", stream_options={"include_usage": True})
    r = await stream(http, eng.url, body)
    assert r["events"][-1] == "[DONE]"
    chunks = r["chunks"]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1
    assert ids.pop().startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["tokenrelay"]["engine_id"] == "mock-0"
    content = chunks[1:-2]
    assert content
    assert all(c["choices"][0]["finish_reason"] is None for c in content)
    final = chunks[-2]["choices"][0]
    assert final["delta"] == {}
    assert final["finish_reason"] == "stop"
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == len(content)
    assert r["headers"]["x-engine-id"] == "mock-0"
    assert r["headers"]["x-prefix-cache-hit-tokens"] == "0"


async def test_same_prompt_gives_the_same_reply_across_engines(start: StartEngine, http) -> None:
    a, b = await start(**FAST), await start(**FAST)
    ra = reply_text(await stream(http, a.url, chat("same prompt")))
    rb = reply_text(await stream(http, b.url, chat("same prompt")))
    rc = reply_text(await stream(http, a.url, chat("another prompt")))
    assert ra == rb
    assert ra != rc
    assert re.fullmatch(r"[A-Z][a-z]+([ .a-zA-Z]+)", ra)


async def test_a_reply_seed_header_gives_another_reply_to_the_same_prompt(
    start: StartEngine, http
) -> None:
    """What a regenerate sends (the worker: X-Reply-Seed, the new turn's number)."""
    eng = await start(**FAST)
    plain = reply_text(await stream(http, eng.url, chat("same prompt")))
    two = reply_text(await stream(http, eng.url, chat("same prompt"), {"X-Reply-Seed": "2"}))
    again = reply_text(await stream(http, eng.url, chat("same prompt"), {"X-Reply-Seed": "2"}))
    three = reply_text(await stream(http, eng.url, chat("same prompt"), {"X-Reply-Seed": "3"}))
    assert len({plain, two, three}) == 3
    assert two == again
    async with http.post(
        f"{eng.url}/v1/chat/completions", json=chat("x"), headers={"X-Reply-Seed": "²"}
    ) as resp:
        assert resp.status == 400
        assert "X-Reply-Seed" in (await resp.json())["error"]["message"]


async def test_max_tokens_cuts_the_reply_with_finish_length(start: StartEngine, http) -> None:
    eng = await start(**FAST)
    r = await stream(http, eng.url, chat("count", max_tokens=2))
    assert len(r["chunks"]) == 4  # role, 2 tokens, final
    assert r["chunks"][-1]["choices"][0]["finish_reason"] == "length"


async def test_non_stream_returns_a_chat_completion(start: StartEngine, http) -> None:
    eng = await start(**FAST)
    async with http.post(f"{eng.url}/v1/chat/completions", json=chat("hi")) as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == reply_text(
        await stream(http, eng.url, chat("hi"))
    )
    assert body["choices"][0]["finish_reason"] == "stop"
    assert resp.headers["x-engine-id"] == "mock-0"


async def test_second_turn_hits_the_prefix_cache_and_prefills_less(
    start: StartEngine, http
) -> None:
    eng = await start(prefill_tok_per_s=1e6, decode_tok_per_s=0.0)
    system = {"role": "system", "content": "You are a helpful assistant. " * 8}
    turn1 = [system, {"role": "user", "content": "Explain prefix caching please."}]
    r1 = await stream(http, eng.url, {"model": "m", "messages": turn1})
    assert r1["headers"]["x-prefix-cache-hit-tokens"] == "0"
    turn2 = [*turn1, {"role": "assistant", "content": reply_text(r1)}]
    turn2.append({"role": "user", "content": "And then?"})
    r2 = await stream(http, eng.url, {"model": "m", "messages": turn2})
    hit = int(r2["headers"]["x-prefix-cache-hit-tokens"])
    prompt1 = int(r1["headers"]["x-prompt-tokens"])
    completion1 = len(r1["chunks"]) - 2
    assert hit == (prompt1 + completion1) // 16 * 16
    assert r2["chunks"][0]["tokenrelay"]["cached_tokens"] == hit
    assert float(r2["headers"]["x-prefill-s"]) < float(r1["headers"]["x-prefill-s"])
    miss = await stream(http, eng.url, chat("A completely different question"))
    assert miss["headers"]["x-prefix-cache-hit-tokens"] == "0"
    text = await metrics(http, eng.url)
    assert metric(text, "vllm:prefix_cache_hits_total") == hit
    assert metric(text, "vllm:prefix_cache_queries_total") > hit
    assert 0 < metric(text, "vllm:gpu_prefix_cache_hit_rate") < 1
    assert 0 < metric(text, "vllm:gpu_cache_usage_perc") <= 1


async def test_lru_evicts_old_prefixes_at_capacity(start: StartEngine, http) -> None:
    eng = await start(kv_tokens=64, **FAST)  # 4 blocks
    long_a = chat(" ".join(f"a{i}" for i in range(60)), max_tokens=1)
    long_b = chat(" ".join(f"b{i}" for i in range(60)), max_tokens=1)
    await stream(http, eng.url, long_a)
    again = await stream(http, eng.url, long_a)
    assert again["headers"]["x-prefix-cache-hit-tokens"] == "48"
    await stream(http, eng.url, long_b)
    evicted = await stream(http, eng.url, long_a)
    assert evicted["headers"]["x-prefix-cache-hit-tokens"] == "0"
    assert metric(await metrics(http, eng.url), "vllm:gpu_cache_usage_perc") == 1.0


async def test_request_beyond_max_concurrency_waits_in_fifo(start: StartEngine, http) -> None:
    eng = await start(max_concurrency=1, prefill_tok_per_s=0.0, decode_tok_per_s=5.0)
    url = f"{eng.url}/v1/chat/completions"
    async with http.post(url, json=chat("first", stream=True)) as first:
        await first.content.readline()  # admitted and streaming
        second = asyncio.create_task(http.post(url, json=chat("second", stream=True, max_tokens=2)))
        await until(lambda: eng.engine.gate.waiting == 1)
        text = await metrics(http, eng.url)
        assert metric(text, "vllm:num_requests_running") == 1
        assert metric(text, "vllm:num_requests_waiting") == 1
        first.close()  # abort the first: the second is admitted
        resp = await second
        async with resp:
            assert resp.status == 200
            await resp.read()
    await until(lambda: eng.engine.gate.running == 0)
    assert eng.engine.gate.waiting == 0


async def test_client_disconnect_aborts_the_generation(
    start: StartEngine, http, caplog: pytest.LogCaptureFixture
) -> None:
    eng = await start(prefill_tok_per_s=0.0, decode_tok_per_s=20.0)
    async with http.post(f"{eng.url}/v1/chat/completions", json=chat("x", stream=True)) as r:
        await r.content.readline()
        assert eng.engine.gate.running == 1
        r.close()
    await until(lambda: eng.engine.gate.running == 0, within_s=1.0)
    # a client that leaves is an abort, never a server error with a traceback in the log
    assert not [rec for rec in caplog.records if rec.exc_info], caplog.text
    text = await metrics(http, eng.url)
    assert metric(text, "vllm:num_requests_running") == 0
    assert metric(text, "tokenrelay_engine_aborted_requests_total") == 1
    assert metric(text, "vllm:request_success_total", finished_reason="abort") == 1


async def test_disconnect_while_queued_leaves_the_queue(start: StartEngine, http) -> None:
    eng = await start(max_concurrency=1, prefill_tok_per_s=0.0, decode_tok_per_s=2.0)
    url = f"{eng.url}/v1/chat/completions"
    async with http.post(url, json=chat("first", stream=True)) as first:
        await first.content.readline()
        second = asyncio.create_task(http.post(url, json=chat("second", stream=True, max_tokens=2)))
        await until(lambda: eng.engine.gate.waiting == 1)
        second.cancel()
        await until(lambda: eng.engine.gate.waiting == 0, within_s=1.0)
        assert eng.engine.gate.running == 1
    await until(lambda: eng.engine.gate.running == 0, within_s=1.0)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[]", None),
        (b'{"model": "m"}', "messages"),
        (b'{"messages": []}', "messages"),
        (b'{"messages": [{"content": "x"}]}', "messages"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream"),
    ],
)
async def test_bad_input_gets_400_with_openai_error(start: StartEngine, http, body, param) -> None:
    eng = await start(**FAST)
    headers = {"Content-Type": "application/json"}
    async with http.post(f"{eng.url}/v1/chat/completions", data=body, headers=headers) as resp:
        assert resp.status == 400
        err = (await resp.json())["error"]
    assert err["type"] == "invalid_request_error"
    assert err["message"]
    assert err["param"] == param


async def test_huge_body_gets_413(start: StartEngine, http) -> None:
    eng = await start(max_body_bytes=1024, **FAST)
    async with http.post(f"{eng.url}/v1/chat/completions", json=chat("x" * 5000)) as resp:
        assert resp.status == 413
        assert "error" in await resp.json()


async def test_health_and_models(start: StartEngine, http) -> None:
    eng = await start(engine_id="gpu-7", model="llama-mock")
    async with http.get(f"{eng.url}/health") as resp:
        assert (await resp.json())["engine_id"] == "gpu-7"
    async with http.get(f"{eng.url}/v1/models") as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == ["llama-mock"]


async def test_engines_in_one_process_have_separate_metrics(start: StartEngine, http) -> None:
    a, b = await start(**FAST), await start(**FAST)
    await stream(http, a.url, chat("only a"))
    assert metric(await metrics(http, a.url), "vllm:request_success_total") == 1
    with pytest.raises(AssertionError):
        metric(await metrics(http, b.url), "vllm:request_success_total")


async def test_cli_engine_serves_and_stops_cleanly_on_sigterm(http, tmp_path: Path) -> None:
    proc = Proc.start(
        [sys.executable, "-m", "devstack.mockengine.cli", "--port", "0", "--id", "cli-1"],
        log=tmp_path / "engine.out", err_log=tmp_path / "engine.err", name="engine",
    )  # fmt: skip
    try:
        await proc.ready(log_line("\n"), timeout_s=10)
        line = proc.output().splitlines()[0]
        url = line.rsplit(" ", 1)[-1].strip()
        assert url.startswith("http://127.0.0.1:")
        async with http.get(f"{url}/health") as resp:
            assert (await resp.json())["engine_id"] == "cli-1"
        proc.send(signal.SIGTERM)
        assert await proc.wait(10) == 0
    finally:
        await proc.stop()


async def test_replies_take_their_length_from_the_distribution(start: StartEngine, http) -> None:
    eng = await start(**FAST)  # default lengths: mean 300, a tail to 2,000
    dist = ReplyLength()
    for i in range(3):
        body = chat(f"tell me a story {i}")
        r = await stream(http, eng.url, body)
        pieces = [c["choices"][0]["delta"].get("content", "") for c in r["chunks"]]
        natural = dist.length(pc.prompt_tokens(body["messages"]))
        assert sum(1 for p in pieces if p) == natural
        assert r["chunks"][-1]["choices"][0]["finish_reason"] == "stop"
