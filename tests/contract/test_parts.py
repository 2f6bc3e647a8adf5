"""A reply's parts through the producer and the store, once for every store: written in
order with the text, ``done`` covering them, refused before anything corrupt is written,
and a tool-heavy reply (10 tool calls with 1 KB of arguments each, reasoning, text, data)
resumed at 100 random offsets, plain and as a compacted join, rebuilt equal to the
producer's parts every time, each offset of the backlog received exactly once."""

from __future__ import annotations

import json
import random
import secrets
from collections.abc import AsyncIterator

import pytest

from devstack.cluster.launcher import ClusterInfo
from relay.broker.base import Broker
from relay.broker.memstore import MemoryStore
from relay.broker.rediscluster.broker import RedisBroker
from relay.broker.rediscluster.connect import GatedRedisCluster
from relay.broker.rediscluster.store import RedisStore
from relay.client.core import Continuity
from relay.client.transcript import Transcript
from relay.edge.core.compact import Compactor
from relay.edge.core.resume import Delivery
from relay.producer import CoalescePolicy, Producer, TurnClosed, Usage
from relay.protocol.frame import Frame, decode, encode, first_offset, frame_gen
from relay.protocol.parts import PartError

MAX_BYTES = 4 * 1024 * 1024
RESUMES = 100


@pytest.fixture
async def roomy(backend: ClusterInfo | None) -> AsyncIterator[tuple[Producer, Broker]]:
    """A producer and the edge's reads on a store with the default backlog budget (the
    contract's own is 4,000 bytes: too small for a tool-heavy reply)."""
    if backend is None:
        mem = MemoryStore("parts", maxlen=10_000, max_bytes=MAX_BYTES, ttl_s=60)
        yield Producer(mem, keys="k" * 32, coalesce=CoalescePolicy(max_tokens=4)), mem
        return
    host, port = backend.startup_nodes[0]
    redis = GatedRedisCluster(host=host, port=port)
    await redis.initialize()
    try:
        store = RedisStore(redis, maxlen=10_000, max_bytes=MAX_BYTES, ttl_s=60)
        edge = RedisBroker(redis, "parts", maxlen=10_000, ttl_s=60, max_bytes=MAX_BYTES)
        yield Producer(store, keys="k" * 32, coalesce=CoalescePolicy(max_tokens=4)), edge
    finally:
        await redis.aclose()


async def backlog(edge: Broker, sid: str, after: int = 0) -> list[Frame]:
    out: list[Frame] = []
    while True:
        page = await edge.read_page(sid, after, 200, 0)
        if not page.frames:
            return out
        out += [decode(f) for f in page.frames]
        after = out[-1].offset


def args_of(i: int, size: int = 1024) -> str:
    """A call's arguments: a JSON object of about ``size`` bytes."""
    body = {"query": f"q{i}", "pad": ""}
    pad = size - len(json.dumps(body))
    body["pad"] = "x" * max(pad, 0)
    return json.dumps(body)


async def test_parts_go_out_in_order_and_done_covers_them(
    roomy: tuple[Producer, Broker],
) -> None:
    producer, edge = roomy
    s = producer.session("pt-" + secrets.token_hex(4))
    turn = await s.start_turn("weather?", watch=False)
    turn.reasoning("Let me ")
    turn.reasoning("think")
    turn.write("Checking")
    turn.tool_call_start("call_1", "weather")
    turn.tool_call_delta("call_1", '{"city":')
    turn.tool_call_delta("call_1", '"Oslo"}')
    turn.write(" now")
    turn.tool_call_end("call_1")
    turn.tool_result("call_1", {"temp": 4})
    turn.source("https://example.org/w", title="W")
    turn.usage(Usage(prompt_tokens=3, completion_tokens=5))
    turn.data("weather", {"temp": 4})
    await turn.done(finish_reason="tool_calls")
    with pytest.raises(TurnClosed):
        turn.data("late", {})
    frames = await backlog(edge, s.id)
    assert [f.offset for f in frames] == list(range(1, len(frames) + 1))
    kinds = [(f.kind, (f.meta or {}).get("part"), (f.meta or {}).get("phase")) for f in frames]
    end = kinds.index(("part", "reasoning", "end"))  # the text ended the reasoning
    assert kinds[: end + 2] == [
        ("meta", None, None),
        ("part", "reasoning", "start"),
        *[("part", "reasoning", "delta")] * (end - 2),
        ("part", "reasoning", "end"),
        ("token", None, None),
    ]
    assert "".join(f.text for f in frames[2:end]) == "Let me think"
    t, cont = Transcript(s.id), Continuity(0)
    for f in frames:
        ok, problems = cont.accept(f)
        assert ok
        assert problems == []
        t.apply(f)
    reply = t.entries[-1]
    assert reply.text == "Checking now"
    assert [(p.part, p.id, p.name) for p in reply.parts] == [
        ("reasoning", "reasoning-1", ""),
        ("tool-call", "call_1", "weather"),
        ("tool-result", "call_1", "weather"),
        ("source", "source-2", ""),
        ("usage", "usage-3", ""),
        ("data-weather", "data-4", ""),
    ]
    assert reply.parts[1].value() == {"city": "Oslo"}
    assert reply.parts[3].value() == {"url": "https://example.org/w", "title": "W"}
    done = frames[-1].meta or {}
    assert done["parts"] == 6
    assert done["finish_reason"] == "tool_calls"


async def test_text_only_done_is_what_it_was(roomy: tuple[Producer, Broker]) -> None:
    producer, edge = roomy
    s = producer.session("pt-" + secrets.token_hex(4))
    turn = await s.start_turn("hi", watch=False)
    turn.write("Hello")
    await turn.done()
    frames = await backlog(edge, s.id)
    assert [f.kind for f in frames] == ["meta", "token", "done"]
    assert not {"parts", "parts_sha256"} & set(frames[-1].meta or {})


async def test_bad_parts_are_refused_before_anything_is_written(
    roomy: tuple[Producer, Broker],
) -> None:
    producer, edge = roomy
    s = producer.session("pt-" + secrets.token_hex(4))
    turn = await s.start_turn("go", watch=False)
    with pytest.raises(PartError, match="never started"):
        turn.tool_call_delta("ghost", "{}")
    with pytest.raises(PartError, match="not valid JSON"):
        turn.tool_call("c1", "f", '{"a": ')
    with pytest.raises(PartError, match="unknown part type"):
        turn.part("video", "v1", {})
    with pytest.raises(PartError, match="has not finished"):
        turn.tool_result("c9", "x")
    turn.tool_call_start("c2", "f")
    turn.tool_call_delta("c2", '{"a":')
    with pytest.raises(PartError, match="not valid JSON"):
        await turn.done()  # the open call would end corrupt: the turn stays open
    assert not turn.closed
    await turn.error("the tool call broke", code="producer_error")
    frames = await backlog(edge, s.id)
    assert [f.kind for f in frames] == ["meta", "part", "part", "error"]  # c2's start, delta
    assert all((f.meta or {}).get("id") != "ghost" for f in frames)


async def test_a_stopped_turn_leaves_its_open_call_as_it_is(
    roomy: tuple[Producer, Broker],
) -> None:
    producer, edge = roomy
    s = producer.session("pt-" + secrets.token_hex(4))
    turn = await s.start_turn("go", watch=False)
    turn.tool_call_start("c1", "f")
    turn.tool_call_delta("c1", '{"a":')
    await turn.done(finish_reason="cancelled")
    frames = await backlog(edge, s.id)
    t = Transcript(s.id)
    for f in frames:
        t.apply(f)
    call = t.entries[-1].parts[0]
    assert (call.text, call.done, t.entries[-1].finish) == ('{"a":', False, "cancelled")


async def test_a_tool_heavy_reply_resumed_anywhere_is_the_producers_parts(
    roomy: tuple[Producer, Broker],
) -> None:
    producer, edge = roomy
    s = producer.session("pt-" + secrets.token_hex(4))
    turn = await s.start_turn("plan a trip", watch=False)
    rng = random.Random(7)
    for i in range(10):
        turn.reasoning(f"step {i}: ")
        turn.reasoning("which tool")
        turn.end_reasoning()
        turn.write(f"Calling {i}. ")
        cid, args = f"call_{i}", args_of(i)
        turn.tool_call_start(cid, f"tool_{i % 3}")
        at = 0
        while at < len(args):
            n = rng.randint(1, 40)
            turn.tool_call_delta(cid, args[at : at + n])
            at += n
        turn.tool_call_end(cid)
        turn.tool_result(cid, {"ok": i})
    turn.data("plan", {"calls": 10})
    await turn.done(finish_reason="tool_calls")
    want = [(p.part, p.id, p.name, p.text, p.done) for p in turn.parts.records]
    frames = await backlog(edge, s.id)  # the backlog, as the store holds it
    last = frames[-1].offset
    assert [f.offset for f in frames] == list(range(1, last + 1))
    picks = [rng.randint(0, last) for _ in range(RESUMES)]
    for n, k in enumerate(picks):
        t, cont = Transcript(s.id), Continuity(0)
        seen: list[int] = []
        for f in frames[:k]:  # what the screen had when it dropped
            assert cont.accept(f) == (True, [])
            t.apply(f)
            seen.append(f.offset)
        rest = await backlog(edge, s.id, k)  # the resume, read again from the store
        if n % 2:  # every other resume is a compacted join: each part merges on its own
            c = Compactor()
            ds = [Delivery(f.offset, f.kind, encode(f), f.ts, 0, frame_gen(f)) for f in rest]
            rest = [decode(d.data) for d in c.feed(ds) + c.flush()]
        for f in rest:
            ok, problems = cont.accept(f)
            assert ok
            assert problems == [], (k, problems)
            t.apply(f)
            seen += list(range(first_offset(f), f.offset + 1))
        assert seen == list(range(1, last + 1)), k  # every offset once, none twice
        got = [(p.part, p.id, p.name, p.text, p.done) for p in t.entries[-1].parts]
        assert got == want, k
        assert t.refused == []
