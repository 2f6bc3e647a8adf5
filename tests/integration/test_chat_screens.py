"""Every screen's transcript equals the stored history after stop, regenerate and edit:
two screens watch through a real relay (SSE and WebSocket, the Python client) and apply
the frames to a :class:`relay.client.transcript.Transcript`; a third screen reloads
(the stored page, then the watch from its ``resume_from``). The history is read from
Redis, the source of truth."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp
import pytest
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from relay.client.controls import ControlRefused, cancel, delete_session, load_messages
from relay.client.stream import WatchRefused, watch
from relay.client.transcript import Transcript
from relay.protocol.keys import hist_key
from tests.support import relay as relay_support
from tests.support.worker import Harness, wait_turn

pytestmark = [pytest.mark.integration]


async def _stored(redis: RedisCluster, sid: str) -> list[dict[str, Any]]:
    raw = await redis.lrange(hist_key(sid), 0, -1)
    return [
        {"role": m["role"], "content": m["content"], "turn": m["turn"]}
        for m in (json.loads(x) for x in raw)
    ]


class Screen:
    """A screen: a watch applied to a transcript, until closed."""

    def __init__(self, relay: str, sid: str, token: str, transport: str, after: int = 0,
                 gen: str | None = None, transcript: Transcript | None = None) -> None:  # fmt: skip
        self.transcript = transcript or Transcript(sid)
        self.last = after
        self.refused: WatchRefused | None = None  # how the relay ended it (a delete)
        self._w = watch(relay, sid, token, after, transport=transport, gen=gen)  # type: ignore[arg-type]
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        try:
            async for f in self._w:
                self.transcript.apply(f)
                if f.kind != "presence":  # a screen count: offset 0, not a resume point
                    self.last = f.offset
        except WatchRefused as exc:  # the session was deleted: its streams end
            self.refused = exc

    async def until(self, offset: int, timeout_s: float = 15.0) -> None:
        async with asyncio.timeout(timeout_s):
            while self.last < offset:
                await asyncio.sleep(0.02)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._w.aclose()


@pytest.mark.timeout(120)
async def test_every_screen_holds_the_stored_history_after_stop_regenerate_and_edit(
    cluster: ClusterInfo, h: Harness, redis: RedisCluster
) -> None:
    await h.start_engines(1, decode_tok_per_s=40.0)
    await h.start_worker()
    worker = h.url("").rstrip("/")
    async with relay_support.running(cluster) as relay, aiohttp.ClientSession() as http:
        sid, token = await h.session()
        screens = [Screen(relay.base, sid, token, "sse"), Screen(relay.base, sid, token, "ws")]
        try:
            last = 0
            for body in (
                {"message": "first question", "max_tokens": 8},
                {"message": "second question", "max_tokens": 8},
                {"regenerate": True, "max_tokens": 8},
                {"replaces": 1, "message": "first, edited", "max_tokens": 8},
                {"message": "a long one", "max_tokens": 400},
            ):
                status, started, _ = await h.post_turn(sid, token, body)
                assert status == 202, started
                if body.get("max_tokens") == 400:  # stopped by a screen
                    await screens[0].until(started["offset"] + 1)
                    ack = await cancel(http, worker, sid, token)
                    assert ack["status"] == "stopping"
                frames = await wait_turn(redis, sid, started["turn"])
                last = frames[-1].offset
            for s in screens:
                await s.until(last)
            stored = await _stored(redis, sid)
            assert [(m["turn"], m["role"]) for m in stored] == [
                (4, "user"), (4, "assistant"), (5, "user"), (5, "assistant")
            ]  # fmt: skip
            assert screens[0].transcript.entries[-1].finish == "cancelled"
            for s in screens:
                assert s.transcript.history() == stored
            # a screen that reloads: the stored page, then the watch from its resume_from
            page = await load_messages(http, worker, sid, token)
            reloaded = Transcript(sid)
            reloaded.load(page)
            assert page["running"] is None
            assert reloaded.history() == stored
            assert reloaded.entries[-1].finish == "cancelled"
            later = Screen(
                relay.base, sid, token, "sse", page["resume_from"], page["gen"], reloaded
            )
            screens.append(later)
            status, started, _ = await h.post_turn(
                sid, token, {"regenerate": True, "max_tokens": 8}
            )
            assert status == 202
            frames = await wait_turn(redis, sid, started["turn"])
            for s in screens:
                await s.until(frames[-1].offset)
            stored = await _stored(redis, sid)
            for s in screens:
                assert s.transcript.history() == stored
            with pytest.raises(ControlRefused) as refused:
                await cancel(http, worker, sid, token, started["turn"])
            assert refused.value.status == 409
            assert refused.value.code == "turn_finished"
            assert refused.value.body["offset"] == frames[-1].offset
            await delete_session(http, worker, sid, token)
            async with asyncio.timeout(10):  # every screen's stream ended, and stays refused
                while not all(s.refused is not None for s in screens):
                    await asyncio.sleep(0.02)
            with pytest.raises(ControlRefused) as refused:
                await delete_session(http, worker, sid, token)
            assert (refused.value.status, refused.value.code) == (404, "unknown_session")
        finally:
            for s in screens:
                await s.close()


@pytest.mark.timeout(60)
async def test_a_compacted_late_joiner_holds_the_stored_history_in_three_frames_a_turn(
    cluster: ClusterInfo, h: Harness, redis: RedisCluster
) -> None:
    await h.start_engines(1, decode_tok_per_s=400.0)
    await h.start_worker()
    async with relay_support.running(cluster) as relay:
        sid, token = await h.session()
        last = 0
        for i in range(4):
            status, started, _ = await h.post_turn(
                sid, token, {"message": f"q{i}", "max_tokens": 24}
            )
            assert status == 202
            last = (await wait_turn(redis, sid, started["turn"]))[-1].offset
        for transport in ("sse", "ws"):
            per_turn: dict[int, int] = {}
            transcript = Transcript(sid)
            w = watch(relay.base, sid, token, 0, transport=transport, compact=True)
            async for f in w:
                if f.kind == "presence":
                    continue
                per_turn[f.turn] = per_turn.get(f.turn, 0) + 1
                transcript.apply(f)
                if f.offset >= last:
                    break
            await w.aclose()
            assert set(per_turn) == {1, 2, 3, 4}
            assert max(per_turn.values()) <= 3, per_turn
            assert w.stats.problems == 0
            assert transcript.history() == await _stored(redis, sid)
