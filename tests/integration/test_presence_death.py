"""The screen count after a relay is killed with SIGKILL: right again within 10 s.

Four screens watch one session, two on each of two ``tokenrelay relay`` processes; one
relay is killed (``kill -9``: it removes nothing of its own), its two screens reconnect
to the other relay, as a client behind a load balancer does. For a moment every screen
is told six (the four open ones and the dead relay's two, whose presence entry still
lives); the count must be four again within 10 s of the kill, the bound
docs/PROTOCOL.md states ("The presence frame": the dead relay's heartbeat stops, the
surviving relay takes it for dead 5 s later and drops its screens at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import WSMsgType

from devstack.cluster.launcher import ClusterInfo
from relay.protocol.auth import issue_token
from relay.protocol.keys import new_session_id
from tests.support.relay import RelayProcess, relay_process
from tests.support.worker import SECRET

pytestmark = pytest.mark.integration

BOUND_S = 10.0  # the count is right again this long after the kill, at most
FLAGS = ("--reap-after-s", "0", "--heartbeat-s", "5")


class Screen:
    """One WebSocket screen: every presence count it was sent, with when it came."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.counts: list[tuple[float, int]] = []
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type is not WSMsgType.TEXT:
                break
            obj = json.loads(msg.data)
            if obj.get("kind") == "presence":
                self.counts.append((time.monotonic(), int(obj["meta"]["screens"])))

    @property
    def now(self) -> int | None:
        return self.counts[-1][1] if self.counts else None

    async def until(self, n: int, within_s: float, since: float = 0.0) -> float:
        """When this screen was first told ``n`` after ``since`` (monotonic)."""
        async with asyncio.timeout(within_s):
            while True:
                for at, c in self.counts:
                    if at >= since and c == n:
                        return at
                await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def screens(
    http: aiohttp.ClientSession, relay: RelayProcess, sid: str, n: int
) -> AsyncIterator[list[Screen]]:
    token = issue_token(SECRET, sid, 300, time.time())
    out: list[Screen] = []
    try:
        for _ in range(n):
            ws = await http.ws_connect(
                f"{relay.base.replace('http', 'ws', 1)}/v1/sessions/{sid}/ws",
                headers={"Authorization": f"Bearer {token}"},
            )
            out.append(Screen(ws))
        yield out
    finally:
        for s in out:
            s.task.cancel()
            with contextlib.suppress(Exception):
                await s.ws.close()


async def test_the_screen_count_is_right_within_10_s_of_a_relay_killed_by_sigkill(
    cluster: ClusterInfo, tmp_path_factory: pytest.TempPathFactory
) -> None:
    log_dir = tmp_path_factory.mktemp("presence-death")
    sid = new_session_id()
    async with (
        relay_process(cluster, log_dir, "edge-doomed", *FLAGS) as doomed,
        relay_process(cluster, log_dir, "edge-survivor", *FLAGS) as survivor,
        aiohttp.ClientSession() as http,
        screens(http, doomed, sid, 2),
        screens(http, survivor, sid, 2) as staying,
    ):
        for s in staying:
            await s.until(4, within_s=15.0)
        killed_at = time.monotonic()
        doomed.proc.kill()  # SIGKILL: no goodbye, no count written back to 0
        async with screens(http, survivor, sid, 2) as back:  # its screens reconnect here
            every = [*staying, *back]
            # too many for a moment: the dead relay's two still count
            six = await staying[0].until(6, within_s=BOUND_S, since=killed_at)
            try:
                right = max([await s.until(4, within_s=BOUND_S + 5, since=six) for s in every])
            except TimeoutError:
                late = time.monotonic() - killed_at
                raise AssertionError(
                    f"still {[s.now for s in every]} screens {late:.1f} s after the kill"
                ) from None
            took = right - killed_at
            print(f"screen count right again {took:.1f} s after the kill")
            assert took <= BOUND_S, f"the dead relay's screens counted for {took:.1f} s"
            await asyncio.sleep(1.0)  # and it stays right
            assert [s.now for s in every] == [4, 4, 4, 4]
