"""The product on a real engine: llama.cpp's own ``llama-server`` (built once per machine
from the llama.cpp source in the ``llama-cpp-python`` sdist, ``python -m devstack llama
build``) serving SmolLM2-135M-Instruct (Q4_1) on the CPU, two servers of two slots each,
an in-process worker on the real cluster, a relay for the screens.

What the mock engine cannot show: real model text through every front, the engine's own
cache reports (``timings``, ``usage.prompt_tokens_details``) read at the end of a reply,
its own error for a prompt over its context, its slots freed by a stop, a server killed
mid-reply. They run in ``make test`` wherever the engine is built (the build is not part
of it: about 11 minutes on two quiet cores); ``make test-real-engine`` builds it first and
runs them. Where it is not built, or cannot be built here, they skip and say why.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from devstack.llama.build import Built, find, missing_toolchain
from devstack.llama.serve import MODEL, LlamaServer, llama_servers
from relay.broker.rediscluster.publisher import read_backlog
from relay.client.controls import cancel
from relay.protocol.frame import Frame, decode
from relay.protocol.sse_reader import SSEDecoder
from tests.integration.test_chat_screens import Screen, _stored
from tests.support import relay as relay_support
from tests.support.worker import Harness, wait_turn

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.real_engine]

KEY = "gw-test-key-0123456789"
SLOTS = 2
CTX = 2048  # shared by the slots: 1,024 tokens each


@pytest.fixture(scope="session")
def built() -> Built:
    """The cached llama-server and model. They run in `make test` wherever the engine
    is built (`make test-real-engine` builds it first); else a skip that says how."""
    found = find()
    if found is None:
        why = missing_toolchain() or (
            "llama-server is not built on this machine: make llama-engine "
            "(python -m devstack llama build, about 11 minutes on two cores)"
        )
        pytest.skip(why)
    return found


@pytest.fixture
async def engines(built: Built, tmp_path: Path) -> AsyncIterator[list[LlamaServer]]:
    async with llama_servers(built, 2, tmp_path, slots=SLOTS, ctx=CTX) as servers:
        yield servers


async def start_worker(h: Harness, engines: list[LlamaServer], **kw: Any) -> None:
    kw.setdefault("first_token_timeout_s", 180.0)  # a CPU engine on a busy machine
    kw.setdefault("idle_timeout_s", 60.0)
    await h.start_worker(
        cap=SLOTS, engine_urls=tuple(f"{e.id}={e.url}" for e in engines), model=MODEL,
        gateway_keys=(KEY,), admit_wait_s=5.0, **kw,
    )  # fmt: skip
    # the workers read each server's slots and context from its /props
    await until(lambda: all(h.state.router.profiles.get(e.id).slots == SLOTS for e in engines))


async def until(cond: Callable[[], bool], within_s: float = 30.0) -> None:
    async with asyncio.timeout(within_s):
        while not cond():
            await asyncio.sleep(0.05)


async def closed_loop(h: Harness, sid: str, token: str, body: dict[str, Any]) -> list[Frame]:
    """A turn on the POST that started it: its frames, meta to done."""
    assert h.http is not None
    frames: list[Frame] = []
    async with h.http.post(
        h.url(f"/v1/sessions/{sid}/turns"), json=body,
        headers={"Authorization": f"Bearer {token}", "Accept": "text/event-stream"},
    ) as resp:  # fmt: skip
        assert resp.status == 200, await resp.text()
        dec = SSEDecoder()
        async for chunk in resp.content.iter_any():
            for ev in dec.feed(chunk):
                if ev.event in ("meta", "token", "done", "error"):
                    frames.append(decode(ev.data.encode()))
    return frames


async def slots_idle(engine: LlamaServer, http: aiohttp.ClientSession) -> bool:
    async with http.get(engine.url + "/slots") as r:
        return not any(s.get("is_processing") for s in await r.json())


async def test_the_closed_loop_streams_model_text_and_the_engines_cache_report(
    engines: list[LlamaServer], h: Harness
) -> None:
    """Every turn says its cache as llama-server reported it (``cache: "unknown"`` on
    63-78 % of real turns before: the report comes in the last chunk), and the second
    turn reuses the first one's prefix on the same engine."""
    await start_worker(h, engines)
    sid, token = await h.session()
    first = await closed_loop(h, sid, token, {"message": "Name three colors.", "max_tokens": 12})
    assert first[0].kind == "meta"
    assert first[-1].kind == "done", first[-1]
    assert "".join(f.text for f in first if f.kind == "token").strip()
    d1 = first[-1].meta
    assert d1 is not None
    assert d1["cache"] in ("hit", "miss")
    assert d1["prompt_tokens"] > 0
    assert d1["computed_tokens"] == d1["prompt_tokens"] - d1["cached_tokens"]
    second = await closed_loop(h, sid, token, {"message": "And three more?", "max_tokens": 12})
    d2 = second[-1].meta
    assert d2 is not None
    assert second[-1].kind == "done", second[-1]
    assert d2["engine"] == d1["engine"]
    assert d2["cache"] == "hit"
    # the first prompt (and reply, re-tokenized to the engine's own tokens) was reused
    assert d2["cached_tokens"] >= d1["prompt_tokens"] - 1
    assert d2["computed_tokens"] == d2["prompt_tokens"] - d2["cached_tokens"]
    # the profile learned the engine's prefill and decode rates from its timings
    learned = h.state.router.profiles.learned(d1["engine"])
    assert learned.decode_tok_per_s > 0


async def test_two_screens_stop_and_regenerate_on_a_real_engine(
    engines: list[LlamaServer], cluster: ClusterInfo, h: Harness, redis: RedisCluster
) -> None:
    await start_worker(h, engines)
    worker = h.url("").rstrip("/")
    async with relay_support.running(cluster) as relay, aiohttp.ClientSession() as http:
        sid, token = await h.session()
        screens = [Screen(relay.base, sid, token, "sse"), Screen(relay.base, sid, token, "ws")]
        try:
            last = 0
            for body in (
                {"message": "Say hello.", "max_tokens": 10},
                {"message": "Write a long story about the sea.", "max_tokens": 300},
                {"regenerate": True, "max_tokens": 10},
            ):
                status, started, _ = await h.post_turn(sid, token, body)
                assert status == 202, started
                if body.get("max_tokens") == 300:  # stopped by a screen at its first token
                    await screens[0].until(started["offset"] + 1, timeout_s=180)
                    ack = await cancel(http, worker, sid, token)
                    assert ack["status"] == "stopping"
                frames = await wait_turn(redis, sid, started["turn"], timeout_s=180)
                assert frames[-1].kind == "done", frames[-1]
                if body.get("max_tokens") == 300:
                    assert frames[-1].meta is not None
                    assert frames[-1].meta["finish_reason"] == "cancelled"
                    # the engine stopped at its next token: its slots are free again
                    async with asyncio.timeout(20):
                        while not all([await slots_idle(e, http) for e in engines]):
                            await asyncio.sleep(0.2)
                last = frames[-1].offset
            for s in screens:
                await s.until(last, timeout_s=30)
            stored = await _stored(redis, sid)
            assert [(m["turn"], m["role"]) for m in stored] == [
                (1, "user"), (1, "assistant"), (3, "user"), (3, "assistant")
            ]  # fmt: skip
            assert stored[2]["content"] == "Write a long story about the sea."
            assert stored[3]["content"].strip()
            for s in screens:
                assert s.transcript.history() == stored
        finally:
            for s in screens:
                await s.close()


async def test_the_openai_gateway_and_the_responses_api_on_a_real_engine(
    engines: list[LlamaServer], h: Harness
) -> None:
    await start_worker(h, engines)
    client = openai.AsyncOpenAI(base_url=h.url("/v1"), api_key=KEY, max_retries=0)
    try:
        msgs: list[Any] = [{"role": "system", "content": "You are terse."},
                           {"role": "user", "content": "What is the sea?"}]  # fmt: skip
        seen, cached = [], []
        for _ in range(2):
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=msgs, max_tokens=10
            )
            seen.append(raw.headers["x-engine-id"])
            r = raw.parse()
            assert r.choices[0].message.content
            assert r.usage is not None
            details = r.usage.prompt_tokens_details
            cached.append(details.cached_tokens if details is not None else None)
            msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "Say more."}]  # fmt: skip
        assert seen[0] == seen[1]
        assert cached[1] is not None
        assert cached[1] > 0
        text = []
        stream = await client.chat.completions.create(
            model=MODEL, messages=msgs[:2], max_tokens=8, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        usage = None
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
            usage = chunk.usage or usage
        assert "".join(text).strip()
        assert usage is not None
        assert usage.prompt_tokens > 0
        resp = await client.responses.create(
            model=MODEL, input="Name a fish.", instructions="You are terse.",
            max_output_tokens=10,
        )  # fmt: skip
        assert resp.output_text.strip()
        assert resp.usage is not None
        assert resp.usage.input_tokens > 0
        again = await client.responses.retrieve(resp.id)
        assert again.output_text == resp.output_text
    finally:
        await client.close()


async def test_a_prompt_over_the_context_is_prompt_too_long_with_the_engines_reason(
    engines: list[LlamaServer], h: Harness, redis: RedisCluster
) -> None:
    await start_worker(h, engines)
    sid, token = await h.session()
    long = "the sea is wide and deep " * 300  # about 1,800 tokens: over a 1,024-token slot
    status, started, _ = await h.post_turn(sid, token, {"message": long, "max_tokens": 8})
    assert status == 202, started
    end = (await wait_turn(redis, sid, started["turn"], timeout_s=120))[-1]
    assert end.kind == "error"
    assert end.meta is not None
    assert end.meta["code"] == "prompt_too_long"
    assert "exceeds the available context size" in end.text
    client = openai.AsyncOpenAI(base_url=h.url("/v1"), api_key=KEY, max_retries=0)
    try:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=8
            )
        assert refused.value.code == "context_length_exceeded"
    finally:
        await client.close()


async def test_an_engine_killed_mid_reply_ends_the_turn_and_the_next_goes_elsewhere(
    engines: list[LlamaServer], h: Harness, redis: RedisCluster
) -> None:
    await start_worker(h, engines, control_interval_s=0.2)
    sid, token = await h.session()
    status, started, _ = await h.post_turn(
        sid, token, {"message": "Write a long story about the sea.", "max_tokens": 400}
    )
    assert status == 202, started
    turn = started["turn"]
    async with asyncio.timeout(180):  # its first tokens are out
        while True:
            frames = await wait_turn_frames(redis, sid, turn)
            if any(f.kind == "token" for f in frames):
                break
            await asyncio.sleep(0.1)
    meta = frames[0].meta
    assert meta is not None
    victim = next(e for e in engines if e.id == meta["engine"])
    victim.proc.send(signal.SIGKILL)
    end = (await wait_turn(redis, sid, turn, timeout_s=60))[-1]
    assert end.kind == "error"
    # the broken connection, or the control plane's probes first (the engine is gone)
    assert end.text in ("engine connection lost mid-stream", "engine down"), end
    nxt = await closed_loop(h, sid, token, {"message": "Say hello.", "max_tokens": 8})
    assert nxt[-1].kind == "done", nxt[-1]
    assert nxt[-1].meta is not None
    assert nxt[-1].meta["engine"] != victim.id


async def wait_turn_frames(redis: RedisCluster, sid: str, turn: int) -> list[Frame]:
    raw, _, _ = await read_backlog(redis, sid, 0, 10_000)
    return [f for f in (decode(x) for x in raw) if f.turn == turn]
