"""A tool-heavy reply over the real wire: the producer writes 10 tool calls of 1 KB of
arguments each (with reasoning, text and results) into the cluster; a screen reads it
from one relay over SSE, drops at a random point (most of them inside a call's
arguments) and resumes on the other relay, 100 times, every other resume a compacted
join: what it ends with equals the producer's parts every time, and each offset of the
backlog in Redis came exactly once. Durable Streams' JSON mode serves the same reply as
one message per frame, each part's frames among them."""

from __future__ import annotations

import json
import random
import secrets
from typing import Any

import pytest

from devstack.cluster.launcher import ClusterInfo
from relay.broker.rediscluster.connect import GatedRedisCluster
from relay.broker.rediscluster.publisher import read_backlog
from relay.broker.rediscluster.store import RedisStore
from relay.client.core import Continuity
from relay.client.transcript import Transcript
from relay.producer import Producer
from relay.protocol.frame import Frame, decode, first_offset
from tests.support.relay import Relay, running
from tests.support.sse import SSEClient

pytestmark = pytest.mark.integration

RESUMES = 100


async def _write_reply(cluster: ClusterInfo, sid: str) -> list[tuple[str, str, str, str, bool]]:
    host, port = cluster.startup_nodes[0]
    redis = GatedRedisCluster(host=host, port=port)
    await redis.initialize()
    try:
        store = RedisStore(redis, maxlen=10_000, max_bytes=4 * 1024 * 1024, ttl_s=600)
        turn = await Producer(store, keys="k" * 32).session(sid).start_turn("plan", watch=False)
        rng = random.Random(11)
        for i in range(10):
            turn.reasoning(f"step {i}")
            turn.write(f"Calling {i}. ")
            args = json.dumps({"query": f"q{i}", "pad": "x" * 1000})
            turn.tool_call_start(f"call_{i}", "search")
            at = 0
            while at < len(args):
                n = rng.randint(1, 64)
                turn.tool_call_delta(f"call_{i}", args[at : at + n])
                at += n
            turn.tool_call_end(f"call_{i}")
            turn.tool_result(f"call_{i}", {"hits": i})
        await turn.done(finish_reason="tool_calls")
        return [(p.part, p.id, p.name, p.text, p.done) for p in turn.parts.records]
    finally:
        await redis.aclose()


async def _read(relay: Relay, sid: str, after: int, *, until: int,
                compact: bool = False) -> list[Frame]:  # fmt: skip
    """The session's frames from ``relay`` over SSE after offset ``after``, up to the
    frame at offset ``until`` or the turn's done."""
    headers = {**relay.auth(sid), "Last-Event-ID": str(after)}
    params = {"compact": "1"} if compact else {}
    out: list[Frame] = []
    async with relay.http.get(relay.url(sid), headers=headers, params=params) as resp:
        assert resp.status == 200, await resp.text()
        client = SSEClient(resp)
        while not out or (out[-1].offset < until and out[-1].kind != "done"):
            ev = await client.next_event()
            assert ev is not None
            out.append(decode(json.dumps(ev[2])))
    return out


async def test_a_screen_resumes_a_tool_heavy_reply_on_another_relay(
    cluster: ClusterInfo, redis: Any
) -> None:
    sid = "pr-" + secrets.token_hex(4)
    want = await _write_reply(cluster, sid)
    raw, _, _ = await read_backlog(redis, sid, 0, 100_000)  # the backlog in Redis
    backlog = [decode(f) for f in raw]
    last = backlog[-1].offset
    assert [f.offset for f in backlog] == list(range(1, last + 1))
    inside = [f.offset for f in backlog
              if f.kind == "part" and (f.meta or {}).get("phase") == "delta"]  # fmt: skip
    rng = random.Random(5)
    picks = [rng.choice(inside) if i % 4 else rng.randint(1, last) for i in range(RESUMES)]
    async with running(cluster, relay_id="edge-a") as a, running(cluster, relay_id="edge-b") as b:
        for n, k in enumerate(picks):
            t, cont, seen = Transcript(sid), Continuity(0), []
            for f in await _read(a, sid, 0, until=k):  # the screen until it dropped
                assert cont.accept(f) == (True, [])
                t.apply(f)
                seen += list(range(first_offset(f), f.offset + 1))
            for f in await _read(b, sid, k, until=last, compact=bool(n % 2)):
                ok, problems = cont.accept(f)
                assert ok
                assert problems == [], (k, problems)
                t.apply(f)
                seen += list(range(first_offset(f), f.offset + 1))
            assert seen == list(range(1, last + 1)), k  # each offset of the backlog once
            got = [(p.part, p.id, p.name, p.text, p.done) for p in t.entries[-1].parts]
            assert got == want, k
            assert t.refused == []
        # Durable Streams' JSON mode: one message per frame, the parts among them
        async with b.http.get(f"{b.base}/v1/sessions/{sid}/stream",
                              params={"offset": "-1"}, headers=b.auth(sid)) as resp:  # fmt: skip
            assert resp.status == 200, await resp.text()
            messages = await resp.json()
    assert [decode(json.dumps(m)) for m in messages] == backlog
    t = Transcript(sid)
    for m in messages:
        t.apply(decode(json.dumps(m)))
    assert [(p.part, p.id, p.name, p.text, p.done) for p in t.entries[-1].parts] == want
