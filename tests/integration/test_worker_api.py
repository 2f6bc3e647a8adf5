"""The worker's turn API against a real Redis Cluster and in-process mock engines."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import pytest
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from tests.support.worker import Harness, expected_reply, wait_turn

pytestmark = pytest.mark.integration


async def test_turn_streams_meta_then_tokens_then_done(h: Harness, redis: RedisCluster):
    await h.start_engines(1)
    await h.start_worker()
    sid, token = await h.session()
    status, body, _ = await h.post_turn(sid, token, {"message": "hello there", "system": "be kind"})
    assert status == 202, body
    assert body["session"] == sid
    assert body["turn"] == 1
    frames = await wait_turn(redis, sid, body["turn"])
    assert frames[0].kind == "meta"
    assert frames[0].offset == body["offset"]
    assert frames[0].meta is not None
    assert frames[0].meta["message"] == "hello there"
    assert frames[0].meta["engine"] == "eng-0"
    assert frames[0].meta["spilled"] is False
    assert [f.kind for f in frames[1:-1]] == ["token"] * (len(frames) - 2)
    assert frames[-1].kind == "done"
    offsets = [f.offset for f in frames]
    assert offsets == list(range(offsets[0], offsets[0] + len(frames)))
    prompt = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hello there"}]
    text = "".join(f.text for f in frames if f.kind == "token")
    assert text == expected_reply(prompt, 4096)
    done = frames[-1].meta
    assert done is not None
    assert done["engine"] == "eng-0"
    assert done["engine_reported"] == "eng-0"
    assert done["finish_reason"] == "stop"
    assert done["tokens"] > 0
    assert done["ttft_ms"] is not None
    assert done["cache"] == "miss"
    assert frames[1].meta is not None
    assert "ttft_ms" in frames[1].meta
    assert h.state.router.in_flight() == {"eng-0": 0}
    # coalescing: fewer publishes than tokens
    assert len(frames) - 2 < done["tokens"]


async def test_second_turn_goes_to_the_same_engine_and_hits_its_cache(
    h: Harness, redis: RedisCluster
):
    await h.start_engines(3)
    await h.start_worker()
    sid, token = await h.session()
    s1, b1, _ = await h.post_turn(sid, token, {"message": "tell me about caches"})
    assert s1 == 202
    f1 = await wait_turn(redis, sid, b1["turn"])
    s2, b2, _ = await h.post_turn(sid, token, {"message": "and more please"})
    assert s2 == 202, b2
    f2 = await wait_turn(redis, sid, b2["turn"])
    assert b2["turn"] == b1["turn"] + 1
    assert b2["offset"] == f1[-1].offset + 1
    d1, d2 = f1[-1].meta, f2[-1].meta
    assert d1 is not None
    assert d2 is not None
    assert d2["engine"] == d1["engine"]
    assert d2["cache"] == "hit"
    assert d2["cached_tokens"] > 0
    # the second prompt carried the history: the reply is the mock's reply to it
    reply1 = "".join(f.text for f in f1 if f.kind == "token")
    prompt2 = [
        {"role": "user", "content": "tell me about caches"},
        {"role": "assistant", "content": reply1},
        {"role": "user", "content": "and more please"},
    ]
    assert "".join(f.text for f in f2 if f.kind == "token") == expected_reply(prompt2, 4096)
    metrics = h.state.metrics.render().decode()
    assert "tokenrelay_worker_cache_affinity_captured_total 1.0" in metrics


async def test_all_engines_full_is_429_with_integer_retry_after(h: Harness, redis: RedisCluster):
    await h.start_engines(2, decode_tok_per_s=20.0)
    # no queue past the cap: the refusal at the cap is what this test is about (the queue
    # has its own: test_a_turn_queues_past_the_cap_then_every_engine_full_is_429)
    await h.start_worker(cap=1, admit_wait_s=0.2, route_queue=0.0)
    running = []
    for i in range(2):
        sid, token = await h.session()
        status, body, _ = await h.post_turn(sid, token, {"message": f"long story {i}"})
        if status == 202:
            running.append((sid, body["turn"]))
    # Two engines of cap 1 hold at most two turns; the bounded-load rule may refuse the
    # second before the engines' caps do. Fill until refused.
    sid, token = await h.session()
    status, body, headers = await h.post_turn(sid, token, {"message": "one more"})
    assert status == 429, body
    assert body["error"] == "engines_full"
    assert headers["Retry-After"].isdigit()
    assert int(headers["Retry-After"]) >= 1
    for s, t in running:
        await wait_turn(redis, s, t, timeout_s=20)


async def test_a_turn_queues_past_the_cap_then_every_engine_full_is_429(
    h: Harness, redis: RedisCluster
):
    """cost_aware's queue past the cap: an engine of cap 1 with a queue of 2 x its cap
    takes three turns (two counted as queued_past_cap in the route metrics); the fourth
    finds every engine full: 429 engines_full."""
    await h.start_engines(1, decode_tok_per_s=20.0)
    await h.start_worker(cap=1, admit_wait_s=0.2, route_queue=2.0)
    running = []
    for i in range(3):
        sid, token = await h.session()
        status, body, _ = await h.post_turn(sid, token, {"message": f"long story {i}"})
        assert status == 202, body
        running.append((sid, body["turn"]))
    assert h.state.router.snapshot()["engines"]["eng-0"]["queued"] == 2
    sid, token = await h.session()
    status, body, headers = await h.post_turn(sid, token, {"message": "one more"})
    assert status == 429, body
    assert body["error"] == "engines_full"
    assert int(headers["Retry-After"]) >= 1
    metrics = h.state.metrics.render().decode()
    line = 'route_decisions_total{policy="cost_aware",reason="queued_past_cap"} 2.0'
    assert line in metrics
    for s, t in running:
        await wait_turn(redis, s, t, timeout_s=20)


async def test_a_turn_waits_for_a_slot_instead_of_429(h: Harness, redis: RedisCluster):
    await h.start_engines(1, decode_tok_per_s=20.0)  # 10 tokens: about half a second
    # no queue past the cap: the second turn must wait for the first one's slot
    await h.start_worker(cap=1, admit_wait_s=4.0, route_queue=0.0)
    sid1, token1 = await h.session()
    status, first, _ = await h.post_turn(sid1, token1, {"message": "a", "max_tokens": 10})
    assert status == 202, first
    assert h.state.router.in_flight() == {"eng-0": 1}  # the only slot is held
    sid2, token2 = await h.session()
    status, second, _ = await h.post_turn(sid2, token2, {"message": "b", "max_tokens": 10})
    assert status == 202, second  # admitted when the first turn released its slot
    await wait_turn(redis, sid1, first["turn"], timeout_s=20)
    await wait_turn(redis, sid2, second["turn"], timeout_s=20)


async def test_idempotency_key_returns_the_same_turn(h: Harness, redis: RedisCluster):
    await h.start_engines(1)
    await h.start_worker()
    sid, token = await h.session()
    hdr = {"Idempotency-Key": "abc-123"}
    s1, b1, _ = await h.post_turn(sid, token, {"message": "hi"}, headers=hdr)
    s2, b2, h2 = await h.post_turn(sid, token, {"message": "hi"}, headers=hdr)
    assert s1 == s2 == 202
    assert b1 == b2
    assert h2.get("Idempotent-Replayed") == "true"
    frames = await wait_turn(redis, sid, b1["turn"])
    s3, b3, _ = await h.post_turn(sid, token, {"message": "hi"}, headers=hdr)
    assert (s3, b3) == (202, b1)  # still the same turn after it ended
    metas = [f for f in frames if f.kind == "meta"]
    assert len(metas) == 1


async def test_second_post_while_generating_is_409_naming_the_running_turn(
    h: Harness, redis: RedisCluster
):
    await h.start_engines(1, decode_tok_per_s=30.0)
    await h.start_worker()
    sid, token = await h.session()
    s1, b1, _ = await h.post_turn(sid, token, {"message": "first"})
    assert s1 == 202
    s2, b2, _ = await h.post_turn(sid, token, {"message": "second"})
    assert s2 == 409
    assert b2["error"] == "turn_in_progress"
    assert b2["turn"] == b1["turn"]
    assert b2["offset"] == b1["offset"]
    await wait_turn(redis, sid, b1["turn"])
    s3, b3, _ = await h.post_turn(sid, token, {"message": "second"})
    assert s3 == 202
    assert b3["turn"] == b1["turn"] + 1
    await wait_turn(redis, sid, b3["turn"])


@pytest.mark.parametrize(
    ("raw", "ctype", "status", "code"),
    [
        (b"{not json", "application/json", 400, "malformed_json"),
        (b"[1, 2]", "application/json", 400, "invalid_body"),
        (b"{}", "application/json", 400, "invalid_message"),
        (b'{"message": ""}', "application/json", 400, "invalid_message"),
        (b'{"message": "   "}', "application/json", 400, "invalid_message"),
        (b'{"message": 5}', "application/json", 400, "invalid_message"),
        (b'{"message": "x", "system": 1}', "application/json", 400, "invalid_system"),
        (b'{"message": "x", "max_tokens": "9"}', "application/json", 400, "invalid_max_tokens"),
        (b'{"message": "x", "max_tokens": true}', "application/json", 400, "invalid_max_tokens"),
        (b'{"message": "x", "max_tokens": 0}', "application/json", 400, "invalid_max_tokens"),
        (b'{"message": "x", "max_tokens": 99999}', "application/json", 400, "invalid_max_tokens"),
        (b'{"message": "x"}', "text/plain", 415, "unsupported_media_type"),
        (b'{"message": "' + b"x" * 70_000 + b'"}', "application/json", 413, "body_too_large"),
        (b'{"message": "' + b"x" * 40_000 + b'"}', "application/json", 413, "message_too_large"),
    ],
)
async def test_bad_bodies_get_a_reason(h: Harness, raw: bytes, ctype: str, status: int, code: str):
    await h.start_engines(1)
    await h.start_worker()
    sid, token = await h.session()
    got, body, _ = await h.post_turn(sid, token, None, raw=raw, headers={"Content-Type": ctype})
    assert (got, body.get("error")) == (status, code), body
    assert body["reason"]


async def test_tokens_are_checked(h: Harness):
    await h.start_engines(1)
    await h.start_worker()
    sid, token = await h.session()
    _other, other_token = await h.session()
    assert (await h.post_turn(sid, None, {"message": "x"}))[0] == 401
    assert (await h.post_turn(sid, other_token, {"message": "x"}))[0] == 403
    assert (await h.post_turn(sid, "garbage.token", {"message": "x"}))[0] == 403
    assert (await h.post_turn("bad{sid}", token, {"message": "x"}))[0] in (400, 404)


async def test_health_ready_and_metrics(h: Harness):
    await h.start_engines(1)
    await h.start_worker()
    assert h.http is not None
    for path in ("/healthz", "/readyz"):
        async with h.http.get(h.url(path)) as r:
            assert r.status == 200
    async with h.http.get(h.url("/metrics")) as r:
        text = await r.text()
    assert "tokenrelay_worker_engine_cap" in text
    assert 'engine="eng-0"' in text
    h.state.turns.draining = True
    async with h.http.get(h.url("/readyz")) as r:
        assert r.status == 503
    sid, token = "abc", None
    async with h.http.post(h.url("/v1/sessions")) as r:
        assert r.status == 503
    del sid, token


async def test_turn_request_ends_the_engine_stream_when_the_worker_shuts_down(
    h: Harness, redis: RedisCluster
):
    engines = await h.start_engines(1, decode_tok_per_s=10.0)
    await h.start_worker(shutdown_deadline_s=0.3)
    sid, token = await h.session()
    status, body, _ = await h.post_turn(sid, token, {"message": "a long one"})
    assert status == 202
    await asyncio.sleep(0.3)
    await h.state.turns.drain(0.2)
    frames = await wait_turn(redis, sid, body["turn"])
    assert frames[-1].kind == "error"
    assert frames[-1].text == "worker shutdown"
    assert h.state.router.in_flight() == {"eng-0": 0}
    assert (await h.post_turn(sid, token, {"message": "more"}))[0] == 503
    await asyncio.sleep(0.2)
    assert engines[0].engine.gate.running == 0


async def test_the_load_exchange_runs_beside_the_worker(h: Harness, redis: RedisCluster):
    await h.start_engines(1)
    await h.start_worker(load_exchange=True, worker_id="api-test-exchange")
    exchange = h.state.exchange
    assert exchange is not None
    deadline = asyncio.get_running_loop().time() + 5
    while exchange.ticks == 0:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.05)
    assert await redis.zscore("tr:workers", "api-test-exchange") is not None


async def test_a_burst_of_turns_waits_for_redis_connections_instead_of_failing(
    h: Harness, cluster: ClusterInfo
) -> None:
    """300 sessions created and 300 turns posted at once on one worker: every one is
    accepted. Before the worker's client was gated (relay.broker.rediscluster.connect), redis-py
    refused past 100 connections per node: 100 of 400 such turns got 503."""
    await h.start_engines(2)
    await h.start_worker(cap=1000, own_redis_url=cluster.url)
    n = 800
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def one(i: int) -> int:
            async with http.post(h.url("/v1/sessions")) as r:
                if r.status != 201:
                    return r.status
                body = await r.json()
            async with http.post(
                h.url(f"/v1/sessions/{body['session']}/turns"),
                json={"message": f"burst {i}", "max_tokens": 4},
                headers={"Authorization": f"Bearer {body['token']}"},
            ) as r:
                return r.status

        statuses = await asyncio.gather(*(one(i) for i in range(n)))
    assert Counter(statuses) == {202: n}


async def test_prefix_chars_zero_keys_sessions_by_their_system_prompt(
    h: Harness, redis: RedisCluster
):
    await h.start_engines(3)
    await h.start_worker(prefix_chars=0)  # the routing key is the system prompt alone
    engines = set()
    for i in range(6):
        sid, token = await h.session()
        body = {"message": f"question {i}", "system": "one shared prompt", "max_tokens": 4}
        status, started, _ = await h.post_turn(sid, token, body)
        assert status == 202, started
        frames = await wait_turn(redis, sid, started["turn"])
        assert frames[0].meta is not None
        engines.add(frames[0].meta["engine"])
    assert len(engines) == 1  # every session on the prompt's engine (no load to spill)
