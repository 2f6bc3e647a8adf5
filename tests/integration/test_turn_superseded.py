"""A backend that restarts and at once starts its session's next turn: the killed turn
still ends, with exactly one terminal frame, before the next turn's first frame.

Each producer (Python, TypeScript: the conformance drivers, tests/conformance) runs as
its own process and streams a turn to a screen (an SSE client of a relay with its default
reaper); it gets ``kill -9`` and its restarted self starts the next turn as soon as the
dead one's turn lock (1 s here) lets it, before any relay reaps the dead turn (a turn
silent for 2 s). Before, the killed turn then had no ``done`` or ``error`` frame at all:
the reaper ends only the open turn, which was already the next one, so a screen waiting
for the killed turn's end waited forever. Now the next turn's opening ends it first
(lua/open.lua): one ``error`` frame, ``meta.code`` ``superseded``, under the new epoch.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from relay.broker.rediscluster.publisher import read_backlog
from relay.edge.config import RelayConfig
from relay.protocol.frame import decode
from tests.conformance.test_conformance import Spawn
from tests.conformance.test_conformance import spawn as spawn  # the producers' fixture
from tests.support.relay import running, sse
from tests.support.sse import STEP, SSEClient

pytestmark = pytest.mark.integration

REAP_AFTER_S = RelayConfig(redis_url="redis://127.0.0.1:1").reap_after_s  # the default


async def _event(screen: SSEClient) -> tuple[str, dict[str, Any]]:
    ev = await screen.next_event()
    assert ev is not None, "the stream ended"
    return ev[1], ev[2]


async def test_a_restarted_producer_ends_the_turn_it_was_killed_in(
    spawn: Spawn, cluster: ClusterInfo, redis: RedisCluster
) -> None:
    sid = "restart-" + secrets.token_hex(6)
    async with running(cluster, reap_after_s=REAP_AFTER_S) as relay, sse(relay, sid) as screen:
        first, restarted = await spawn(TR_LOCK_TTL_S="1"), await spawn(TR_LOCK_TTL_S="1")
        s1 = await first.send(op="start", session=sid, message="first", watch=True)
        assert s1["ok"], s1
        assert (await first.send(op="write", text="half a rep"))["ok"]
        seen: list[tuple[str, dict[str, Any]]] = []
        async with asyncio.timeout(STEP):
            while not seen or seen[-1][0] != "token":
                seen.append(await _event(screen))
        first.kill()
        await first.proc.wait()
        async with asyncio.timeout(STEP):  # the restarted backend, as soon as it may
            while not (s2 := await restarted.send(op="start", session=sid, message="second",
                                                  watch=True))["ok"]:  # fmt: skip
                assert s2["error"] == "turn_busy", s2
                await asyncio.sleep(0.02)
        assert s2["turn"] == s1["turn"] + 1
        assert (await restarted.send(op="write", text="a whole reply"))["ok"]
        assert (await restarted.send(op="done"))["ok"]
        async with asyncio.timeout(STEP):  # the screen, until the next turn's end
            while not (seen[-1][0] == "done" and seen[-1][1]["turn"] == s2["turn"]):
                seen.append(await _event(screen))
    kinds = [(data["turn"], kind) for kind, data in seen]
    terminal = [(kind, data) for kind, data in seen if kind in ("done", "error")]
    assert [(d["turn"], k) for k, d in terminal] == [(s1["turn"], "error"), (s2["turn"], "done")]
    assert kinds.index((s1["turn"], "error")) < kinds.index((s2["turn"], "meta"))
    _, ended = terminal[0]
    # the restart came before any reaper could look (the turn was silent under 2 s)
    assert ended["meta"]["code"] == "superseded", ended
    assert ended["meta"]["by_turn"] == s2["turn"]
    assert ended["epoch"] == s2["epoch"]  # fenced: the killed producer writes nothing more
    frames, _, _ = await read_backlog(redis, sid, 0, 100)
    ends = [(f.turn, f.kind) for f in map(decode, frames) if f.kind in ("done", "error")]
    assert ends == [(s1["turn"], "error"), (s2["turn"], "done")]  # one terminal frame each
