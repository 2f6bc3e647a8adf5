"""The producer conformance suite: any producer, driven through the line-based JSON
command protocol (``tests/conformance/py_producer.py`` says it), against the real
cluster. What it checks, per producer: the frames written (encoding, offsets, epoch,
meta fields, the ``done`` hash, for every reply of ``vectors.json``), the refusals (one
code per cause), fencing (a stale producer is refused; two racing one session
interleave nothing), a producer killed mid-turn (the reaper's script ends the turn with
``error``), a retry after a lost reply (no duplicate), a long reply past the backlog's
length. Producers: the Python API; the TypeScript package (``clients/producer``) where
node >= 18 and its packages are there (installed from its lock file), else skipped with
the reason. And both languages on one session, turn about: one stream."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import itertools
import json
import os
import secrets
import shutil
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from relay.broker.base import ReapStatus
from relay.broker.rediscluster.publisher import Publisher, read_backlog_page, reap
from relay.protocol.frame import Frame, decode
from relay.protocol.parts import Parts, frame_part, parts_digest
from tests.support.npm import npm_ready

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
VECTORS: dict[str, Any] = json.loads((HERE / "vectors.json").read_text())
NODE_PRODUCER = ROOT / "clients" / "producer" / "conformance.mjs"


async def _command(kind: str) -> list[str]:
    if kind == "python":
        return [sys.executable, "-m", "tests.conformance.py_producer"]
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (apt-get install nodejs npm)")
    if not NODE_PRODUCER.exists():
        pytest.skip("clients/producer has no conformance entry point")
    why = await npm_ready(NODE_PRODUCER.parent, "ioredis")
    if why is not None:
        pytest.skip(f"clients/producer's packages: {why}")
    return [node, str(NODE_PRODUCER)]


class Driver:
    """One producer process: send a command, read its answer. Stopped by its pid."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def send(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), 30)
        assert line, f"the producer exited (rc {self.proc.returncode})"
        out: dict[str, Any] = json.loads(line)
        return out

    def kill(self) -> None:
        if self.proc.returncode is None:
            os.kill(self.proc.pid, signal.SIGKILL)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                os.kill(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()


Spawn = Callable[..., Any]


@contextlib.asynccontextmanager
async def _drivers(cluster: ClusterInfo) -> AsyncIterator[Callable[..., Any]]:
    """``make(argv, **env)``: a producer process ready for commands; all stopped after."""
    drivers: list[Driver] = []

    async def make(argv: list[str], **env: str) -> Driver:
        full = {**os.environ, "TR_REDIS_URL": cluster.url, "PYTHONPATH": str(ROOT), **env}
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=ROOT, env=full, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        d = Driver(proc)
        drivers.append(d)
        assert proc.stdout is not None
        ready = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30) or b"{}")
        assert ready.get("ok"), ready
        return d

    try:
        yield make
    finally:
        for d in drivers:
            await d.stop()


@pytest.fixture(params=["python", "node"])
async def spawn(request: pytest.FixtureRequest, cluster: ClusterInfo) -> AsyncIterator[Spawn]:
    argv = await _command(str(request.param))
    async with _drivers(cluster) as make:
        yield functools.partial(make, argv)


def _sid() -> str:
    return "conf-" + secrets.token_hex(6)


async def _frames(redis: RedisCluster, sid: str) -> tuple[list[Frame], int]:
    page = await read_backlog_page(redis, sid, 0, 100_000)
    return [decode(f) for f in page.frames], page.first


def _check_turn(frames: list[Frame], sid: str, epoch: int, turn: int) -> str:
    """The frame rules of one turn; returns its reply."""
    assert frames[0].kind == "meta"
    assert frames[-1].kind in ("done", "error")
    gens = {(f.meta or {}).get("gen") for f in frames}
    assert len(gens) == 1, gens
    assert None not in gens
    for prev, f in itertools.pairwise(frames):
        assert f.offset == prev.offset + 1
    for f in frames:
        assert (f.v, f.session, f.turn, f.epoch) == (1, sid, turn, epoch)
        assert isinstance(f.ts, int)
        assert f.ts > 0
    assert all(f.kind == "token" for f in frames[1:-1])
    return "".join(f.text for f in frames[1:-1])


@pytest.mark.parametrize("vector", VECTORS["replies"], ids=lambda v: v["name"])
async def test_frames_of_a_turn(spawn: Spawn, redis: RedisCluster, vector: dict[str, Any]) -> None:
    d = await spawn()
    sid = _sid()
    started = await d.send(op="start", session=sid, message="q", meta={"model": "m"})
    assert started["ok"], started
    assert started["turn"] == 1
    assert started["offset"] == 1
    for text in vector["deltas"]:
        assert (await d.send(op="write", text=text))["ok"]
    end = await d.send(op="done", finish_reason=vector["finish_reason"],
                       usage=vector.get("usage"))  # fmt: skip
    assert end["ok"], end
    frames, _ = await _frames(redis, sid)
    assert frames[-1].offset == end["offset"]
    reply = _check_turn(frames, sid, started["epoch"], 1)
    assert reply == "".join(vector["deltas"])
    meta = frames[0].meta or {}
    assert (meta["role"], meta["message"], meta["message_id"]) == ("user", "q", f"{sid}-1-user")
    assert meta["model"] == "m"
    done = frames[-1].meta or {}
    assert done["chars"] == vector["chars"]
    assert done["sha256"] == vector["sha256"] == hashlib.sha256(reply.encode()).hexdigest()
    assert done["tokens"] == len(vector["deltas"])
    assert done["finish_reason"] == vector["finish_reason"]
    if "usage" in vector:
        assert done["usage"] == vector["usage"]


PARTS: list[dict[str, Any]] = [  # one reply's parts, as the part commands write them
    {"part": "reasoning", "id": "r1", "phase": "start"},
    {"part": "reasoning", "id": "r1", "phase": "delta", "text": "Let me "},
    {"part": "reasoning", "id": "r1", "phase": "delta", "text": "think: é"},
    {"part": "reasoning", "id": "r1", "phase": "end"},
    {"text": "Checking"},
    {"part": "tool-call", "id": "call_1", "phase": "start", "name": "weather"},
    {"part": "tool-call", "id": "call_1", "phase": "delta", "text": '{"city":'},
    {"part": "tool-call", "id": "call_1", "phase": "delta", "text": '"Oslo"}'},
    {"part": "tool-call", "id": "call_1", "phase": "end"},
    {"part": "tool-result", "id": "call_1", "name": "weather", "value": {"temp": 4}},
    {"part": "source", "id": "s1", "value": {"url": "https://example.org/w", "title": "W"}},
    {"part": "data-weather", "id": "d1", "value": {"city": "Oslo"}},
    {"text": " done."},
]


async def test_parts_of_a_turn_the_same_from_every_producer(
    spawn: Spawn, redis: RedisCluster
) -> None:
    """Every part a producer writes (docs/PROTOCOL.md, "Parts"): part frames in the
    order written, one part's deltas coalesced apart from the text, the done frame's
    ``parts`` and ``parts_sha256`` (the digest computed here), and the refusals: a delta
    for a call never started, arguments that are not JSON at the call's end, an unknown
    type (``invalid_part``, nothing written), a part after ``done`` (``turn_closed``)."""
    d = await spawn()
    sid = _sid()
    assert (await d.send(op="start", session=sid))["ok"]
    for step in PARTS:
        out = await (
            d.send(op="write", **step) if "part" not in step else d.send(op="part", **step)
        )
        assert out["ok"], (step, out)
    for bad in ({"part": "tool-call", "id": "ghost", "phase": "delta", "text": "{}"},
                {"part": "video", "id": "v1", "value": 1}):  # fmt: skip
        refused = await d.send(op="part", **bad)
        assert refused["error"] == "invalid_part", refused
        assert "\n" not in refused["message"]
    assert (await d.send(op="part", part="tool-call", id="c2", phase="start", name="f"))["ok"]
    assert (await d.send(op="part", part="tool-call", id="c2", phase="delta", text="{"))["ok"]
    broken = await d.send(op="part", part="tool-call", id="c2", phase="end")
    assert broken["error"] == "invalid_part", broken
    assert (await d.send(op="part", part="tool-call", id="c2", phase="delta", text="}"))["ok"]
    end = await d.send(op="done", finish_reason="tool_calls")
    assert end["ok"], end
    late = await d.send(op="part", part="data-x", id="late", value=1)
    assert late["error"] == "turn_closed"
    frames, _ = await _frames(redis, sid)
    parts = Parts()
    for f in frames:
        if f.kind == "part":
            parts.apply(frame_part(f.meta), f.text, f.offset)
    want = [
        (s["part"], s["id"]) for s in PARTS if "part" in s and s.get("phase") in ("start", None)
    ]
    assert [(p.part, p.id) for p in parts.records] == [*want, ("tool-call", "c2")]
    assert all(p.done for p in parts.records)  # done ended the open call
    assert parts.records[0].text == "Let me think: é"
    assert parts.records[1].value() == {"city": "Oslo"}
    assert json.loads(parts.records[2].text) == {"temp": 4}
    assert "".join(f.text for f in frames if f.kind == "token") == "Checking done."
    done = frames[-1].meta or {}
    assert done["parts"] == len(parts.records) == 6
    assert done["parts_sha256"] == parts_digest(parts.records)
    assert not any((f.meta or {}).get("id") in ("ghost", "v1", "late") for f in frames)


async def test_refusals_one_code_per_cause(spawn: Spawn, redis: RedisCluster) -> None:
    d = await spawn()
    bad = await d.send(op="start", session="not a session!")
    assert bad["error"] == "invalid_session"
    assert "\n" not in bad["message"]
    sid = _sid()
    assert (await d.send(op="start", session=sid))["ok"]
    big = await d.send(op="write", text="x" * (256 * 1024))
    assert big["error"] == "frame_too_large"
    assert (await d.send(op="done"))["ok"]
    again = await d.send(op="write", text="late")
    assert again["error"] == "turn_closed"


async def test_a_stale_producer_is_refused_and_racers_interleave_nothing(
    spawn: Spawn, redis: RedisCluster
) -> None:
    a, b = await spawn(), await spawn()
    sid = _sid()
    first, second = await asyncio.gather(
        a.send(op="start", session=sid), b.send(op="start", session=sid)
    )
    assert sorted([first.get("ok", False), second.get("ok", False)]) == [False, True]
    loser = first if not first.get("ok") else second
    assert loser["error"] == "turn_busy"
    winner = a if first.get("ok") else b
    started_epoch = (first if first.get("ok") else second)["epoch"]
    assert (await winner.send(op="write", text="mine"))["ok"]
    # a newer generation (another producer that found the lock expired) fences it
    await Publisher(redis).open_generation(sid)
    await winner.send(op="write", text="stale")
    refused = await winner.send(op="done")
    assert refused["error"] == "stale_epoch", refused
    frames, _ = await _frames(redis, sid)
    # nothing of the fenced epoch after the new one, whose opening ended the fenced turn
    assert [f.epoch for f in frames] == [started_epoch] * (len(frames) - 1) + [started_epoch + 1]
    assert all(f.kind != "done" for f in frames)
    assert (frames[-1].kind, (frames[-1].meta or {})["code"]) == ("error", "superseded")


async def test_a_producer_killed_mid_turn_is_reaped(spawn: Spawn, redis: RedisCluster) -> None:
    d = await spawn(TR_LOCK_TTL_S="1")
    sid = _sid()
    started = await d.send(op="start", session=sid)
    assert (await d.send(op="write", text="half a rep"))["ok"]
    await asyncio.sleep(0.3)  # the first delta is published at once
    d.kill()
    await d.proc.wait()
    for _ in range(40):  # the lock expires 1 s after its last refresh
        res = await reap(redis, sid, reaper="conformance")
        if res.status is ReapStatus.REAPED:
            break
        await asyncio.sleep(0.1)
    assert res.status is ReapStatus.REAPED
    frames, _ = await _frames(redis, sid)
    assert frames[-1].kind == "error"
    assert (frames[-1].meta or {})["code"] == "worker_lost"
    assert frames[-1].epoch == started["epoch"] + 1
    assert "".join(f.text for f in frames if f.kind == "token") == "half a rep"


async def test_a_retry_after_a_lost_reply_writes_nothing_twice(
    spawn: Spawn, redis: RedisCluster
) -> None:
    d = await spawn(TR_COALESCE="1")
    sid = _sid()
    assert (await d.send(op="start", session=sid))["ok"]
    assert (await d.send(op="write", text="once"))["ok"]
    await asyncio.sleep(0.2)
    replay = await d.send(op="replay_last")
    assert replay["ok"], replay
    assert (await d.send(op="done"))["ok"]
    frames, _ = await _frames(redis, sid)
    assert [f.kind for f in frames] == ["meta", "token", "done"]
    assert [f.offset for f in frames] == [1, 2, 3]


async def test_a_long_reply_past_the_backlog_length(spawn: Spawn, redis: RedisCluster) -> None:
    n, maxlen = VECTORS["long_reply"]["deltas"], VECTORS["long_reply"]["maxlen"]
    d = await spawn(TR_COALESCE="1", TR_MAXLEN=str(maxlen))
    sid = _sid()
    assert (await d.send(op="start", session=sid))["ok"]
    deltas = [f"t{i} " for i in range(n)]
    for t in deltas:
        assert (await d.send(op="write", text=t))["ok"]
    end = await d.send(op="done")
    assert end["offset"] == n + 2
    frames, first = await _frames(redis, sid)
    assert first > 1  # trimmed: a client that asks for the start gets a gap frame
    assert len(frames) < n
    assert frames[-1].offset == n + 2
    done = frames[-1].meta or {}
    text = "".join(deltas)
    assert done["chars"] == len(text)
    assert done["sha256"] == hashlib.sha256(text.encode()).hexdigest()


async def test_python_and_node_take_turns_on_one_session(
    cluster: ClusterInfo, redis: RedisCluster
) -> None:
    """Producers of both languages write one session's turns in turn: one stream, its
    offsets consecutive across them, one generation id, each turn's own epoch."""
    py, node = await _command("python"), await _command("node")
    async with _drivers(cluster) as make:
        a, b = await make(py), await make(node)
        sid = _sid()
        texts = ["from python ", "from node ", "from python again"]
        for d, text in zip((a, b, a), texts, strict=True):
            assert (await d.send(op="start", session=sid, message="q"))["ok"]
            assert (await d.send(op="write", text=text))["ok"]
            assert (await d.send(op="done"))["ok"]
        frames, _ = await _frames(redis, sid)
        assert [f.offset for f in frames] == list(range(1, 10))
        for turn in (1, 2, 3):
            of_turn = [f for f in frames if f.turn == turn]
            assert _check_turn(of_turn, sid, of_turn[0].epoch, turn) == texts[turn - 1]
        assert len({(f.meta or {})["gen"] for f in frames}) == 1
        assert [frames[i].epoch for i in (0, 3, 6)] == [1, 2, 3]


_FC = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "search",
       "arguments": "", "status": "in_progress"}  # fmt: skip
# Three streams a producer's pipe carries, as the SDKs send them (the shapes of the openai
# SDK's ResponseStreamEvent and ChatCompletionChunk, of LangChain's AIMessageChunk and
# LangGraph's (chunk, metadata) pairs), and the frames every producer writes for them.
STREAMS: dict[str, list[Any]] = {
    "responses": [
        {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress"}},
        {"type": "response.output_item.added", "output_index": 0,
         "item": {"type": "reasoning", "id": "rs_1", "summary": []}},
        {"type": "response.reasoning_summary_text.delta", "item_id": "rs_1",
         "summary_index": 0, "delta": "Searching "},
        {"type": "response.reasoning_summary_text.delta", "item_id": "rs_1",
         "summary_index": 0, "delta": "first."},
        {"type": "response.reasoning_summary_text.done", "item_id": "rs_1",
         "summary_index": 0, "text": "Searching first."},
        {"type": "response.output_item.added", "output_index": 1, "item": _FC},
        {"type": "response.function_call_arguments.delta", "item_id": "fc_1", "delta": '{"q":'},
        {"type": "response.function_call_arguments.delta", "item_id": "fc_1",
         "delta": '"tides"}'},
        {"type": "response.function_call_arguments.done", "item_id": "fc_1",
         "arguments": '{"q":"tides"}'},
        {"type": "response.output_item.done", "output_index": 1,
         "item": {**_FC, "arguments": '{"q":"tides"}', "status": "completed"}},
        {"type": "response.output_text.delta", "item_id": "msg_1", "delta": "Tides are"},
        {"type": "response.output_text.annotation.added", "item_id": "msg_1",
         "annotation": {"type": "url_citation", "url": "https://example.org/t",
                        "title": "Tides"}},
        {"type": "response.completed", "response": {"usage": {
            "input_tokens": 9, "output_tokens": 6, "total_tokens": 15,
            "input_tokens_details": {"cached_tokens": 4}}}},
    ],
    "langchain": [
        [{"content": "", "additional_kwargs": {"reasoning_content": "Think."},
          "tool_call_chunks": []}, {"langgraph_node": "agent"}],
        [{"content": [{"type": "text", "text": "Sure, "}], "additional_kwargs": {},
          "tool_call_chunks": []}, {}],
        [{"content": "", "additional_kwargs": {},
          "tool_call_chunks": [{"args": '{"id":', "index": 0}]}, {}],
        [{"content": "", "additional_kwargs": {},
          "tool_call_chunks": [{"name": "lookup", "args": " 7}", "id": "t1", "index": 0}]}, {}],
        [{"content": "", "additional_kwargs": {},
          "tool_call_chunks": [{"name": "clock", "id": "t2", "index": 1}]}, {}],
        [{"content": "", "additional_kwargs": {}, "tool_call_chunks": [],
          "usage_metadata": {"input_tokens": 5, "output_tokens": 7, "total_tokens": 12},
          "response_metadata": {"finish_reason": "tool_calls"}}, {}],
    ],
    "chat": [
        {"choices": [{"index": 0, "delta": {"reasoning_content": "One call."}}]},
        {"choices": [{"index": 0, "delta": {"content": "Checking."}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "Then "}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": '{"x"'}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_a",
            "type": "function", "function": {"name": "f", "arguments": ":1}"}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 3,
                                  "total_tokens": 11,
                                  "prompt_tokens_details": {"cached_tokens": 6}}},
    ],
}  # fmt: skip
R, T = "reasoning", "tool-call"
WRITTEN: dict[str, tuple[list[tuple[Any, ...]], dict[str, Any]]] = {
    "responses": ([
        (R, "rs_1-summary-0", "start", "", True, ""),
        (R, "rs_1-summary-0", "delta", "", False, "Searching "),
        (R, "rs_1-summary-0", "delta", "", False, "first."),
        (R, "rs_1-summary-0", "end", "", False, ""),
        (T, "call_1", "start", "search", False, ""),
        (T, "call_1", "delta", "", False, '{"q":'),
        (T, "call_1", "delta", "", False, '"tides"}'),
        (T, "call_1", "end", "", False, ""),
        ("token", "Tides are"),
        ("source", "source-1", None, "", False, '{"url":"https://example.org/t","title":"Tides"}'),
    ], {"finish_reason": "tool_calls", "parts": 3, "usage": {
        "prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15, "cached_tokens": 4}}),
    "langchain": ([
        (R, "reasoning-1", "start", "", False, ""),
        (R, "reasoning-1", "delta", "", False, "Think."),
        (R, "reasoning-1", "end", "", False, ""),
        ("token", "Sure, "),
        (T, "t1", "start", "lookup", False, ""),
        (T, "t1", "delta", "", False, '{"id":'),
        (T, "t1", "delta", "", False, " 7}"),
        (T, "t2", "start", "clock", False, ""),
        (T, "t1", "end", "", False, ""),
        (T, "t2", "delta", "", False, "{}"),
        (T, "t2", "end", "", False, ""),
    ], {"finish_reason": "tool_calls", "parts": 3,
        "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}),
    "chat": ([
        (R, "reasoning-1", "start", "", False, ""),
        (R, "reasoning-1", "delta", "", False, "One call."),
        (R, "reasoning-1", "end", "", False, ""),
        ("token", "Checking."),
        (R, "reasoning-2", "start", "", False, ""),
        (R, "reasoning-2", "delta", "", False, "Then "),
        (T, "call_a", "start", "f", False, ""),
        (T, "call_a", "delta", "", False, '{"x"'),
        (T, "call_a", "delta", "", False, ":1}"),
        (R, "reasoning-2", "end", "", False, ""),  # ended before the calls, by both
        (T, "call_a", "end", "", False, ""),
    ], {"finish_reason": "tool_calls", "parts": 3, "usage": {
        "prompt_tokens": 8, "completion_tokens": 3, "total_tokens": 11, "cached_tokens": 6}}),
}  # fmt: skip


def _written(frames: list[Frame]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for f in frames[1:-1]:
        m = f.meta or {}
        if f.kind == "token":
            out.append(("token", f.text))
        else:
            out.append((m["part"], m["id"], m.get("phase"), m.get("name", ""),
                        bool(m.get("summary")), f.text))  # fmt: skip
    return out


@pytest.mark.parametrize("kind", list(STREAMS))
async def test_pipe_writes_the_same_frames_from_every_producer(
    spawn: Spawn, redis: RedisCluster, kind: str
) -> None:
    """``pipe`` of an OpenAI Responses event stream, of LangChain message chunks (as
    LangGraph pairs) and of chat-completion chunks: every producer writes the same part
    and token frames (one per delta: coalescing off) and the same ``done``."""
    d = await spawn(TR_COALESCE="1")
    sid = _sid()
    assert (await d.send(op="start", session=sid))["ok"]
    end = await d.send(op="pipe", items=STREAMS[kind])
    assert end["ok"], end
    frames, _ = await _frames(redis, sid)
    assert frames[-1].offset == end["offset"]
    want, done = WRITTEN[kind]
    assert _written(frames) == want
    meta = frames[-1].meta or {}
    assert frames[-1].kind == "done"
    assert {k: meta.get(k) for k in done} == done
    parts = Parts()
    for f in frames:
        if f.kind == "part":
            parts.apply(frame_part(f.meta), f.text, f.offset)
    assert meta["parts_sha256"] == parts_digest(parts.records)


async def test_pipe_refuses_a_broken_stream_alike(spawn: Spawn, redis: RedisCluster) -> None:
    """Arguments for a Responses item never added, or a LangChain call whose arguments
    are not JSON: ``invalid_part``, and the turn ends with an ``error`` frame that says
    why (never left open, nothing corrupt written)."""
    d = await spawn(TR_COALESCE="1")
    ghost = [{"type": "response.function_call_arguments.delta", "item_id": "fc_9",
              "delta": "{}"}]  # fmt: skip
    call = {"name": "f", "args": '{"a": nope', "id": "c", "index": 0}
    bad_json = [{"content": "", "additional_kwargs": {}, "tool_call_chunks": [call]}]
    for items, why in ((ghost, "function call arguments for item 'fc_9', never added"),
                       (bad_json, "not valid JSON")):  # fmt: skip
        sid = _sid()
        assert (await d.send(op="start", session=sid))["ok"]
        refused = await d.send(op="pipe", items=items)
        assert refused["error"] == "invalid_part", refused
        frames, _ = await _frames(redis, sid)
        last = frames[-1]
        assert (last.kind, (last.meta or {}).get("code")) == ("error", "producer_error")
        assert last.text.startswith("the stream's parts: ")
        assert why in last.text
