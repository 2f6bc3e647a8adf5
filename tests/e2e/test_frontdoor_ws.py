"""WebSockets through the demo's front door: the token as a subprotocol, and the close a
client gets when its relay dies.

1. A WebSocket through the door that offers ``tokenrelay`` and
   ``tokenrelay.bearer.<token>`` (what the browser client does: no token in its URL)
   is served, and the door answers with the relay's subprotocol, ``tokenrelay``, never
   with the token.
2. The relay under it is killed with SIGKILL: the client gets a close frame with 1012
   (service restart: reconnect), never 1006, which RFC 6455 forbids on the wire (the
   door used to forward the 1006 its own client library reports for a dropped socket).
"""

from __future__ import annotations

import time

import aiohttp
import pytest
from aiohttp import WSMsgType

from devstack.cluster.launcher import ClusterInfo
from devstack.demo.frontdoor import FrontDoor, make_frontdoor_app, sendable_close
from relay.protocol.auth import issue_token
from relay.protocol.keys import new_session_id
from tests.support.http import serve as serving
from tests.support.relay import relay_process
from tests.support.worker import SECRET

pytestmark = pytest.mark.integration


def test_only_codes_a_close_frame_may_carry_are_sent() -> None:
    for code in (1000, 1001, 1003, 1008, 1011, 1012, 1013, 3000, 4008, 4410, 4999):
        assert sendable_close(code) == code
    assert sendable_close(None) == 1012  # the upstream sent no close frame at all
    for code in (0, 999, 1004, 1005, 1006, 1015, 1016, 2000, 2999, 5000):
        assert sendable_close(code) == 1012, code


async def test_a_relay_killed_under_a_websocket_closes_it_with_1012_and_no_token_in_the_url(
    cluster: ClusterInfo, tmp_path_factory: pytest.TempPathFactory
) -> None:
    log_dir = tmp_path_factory.mktemp("door-ws")
    sid = new_session_id()
    token = issue_token(SECRET, sid, 300, time.time())
    async with relay_process(cluster, log_dir, "edge-door", "--reap-after-s", "0") as relay:
        door = FrontDoor(lambda: [relay.base], lambda: [])
        async with serving(make_frontdoor_app(door)) as base, aiohttp.ClientSession() as http:
            url = f"{base.replace('http', 'ws', 1)}/v1/sessions/{sid}/ws"
            assert token not in url
            ws = await http.ws_connect(url, protocols=("tokenrelay", f"tokenrelay.bearer.{token}"))
            assert ws.protocol == "tokenrelay"  # the relay's answer, passed on: not the token
            hello = await ws.receive_json(timeout=10)
            assert hello["type"] == "hello", hello
            relay.proc.kill()  # SIGKILL: the relay sends no close frame
            msg = await ws.receive(timeout=15)
            while msg.type is WSMsgType.TEXT:  # a presence frame may come first
                msg = await ws.receive(timeout=15)
            assert msg.type is WSMsgType.CLOSE, msg
            assert msg.data == 1012, (msg.data, msg.extra)
            await ws.close()
