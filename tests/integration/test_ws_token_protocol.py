"""A WebSocket's token as a subprotocol (``tokenrelay.bearer.<token>`` beside
``tokenrelay``): what a browser sends instead of a token in its URL.

The relay takes the token from the subprotocol and answers with ``tokenrelay`` (never
with the token); a bearer subprotocol without ``tokenrelay`` beside it, or an empty or
forged one, is refused before the upgrade with 403 and a reason; ``?token=`` still
works (compatibility).
"""

from __future__ import annotations

import json
import time

import pytest

from devstack.cluster.launcher import ClusterInfo
from relay.protocol.auth import issue_token
from relay.protocol.keys import new_session_id
from tests.support.relay import SECRET, running

pytestmark = pytest.mark.integration


async def test_the_token_as_a_subprotocol_opens_the_stream_and_is_never_echoed(
    cluster: ClusterInfo,
) -> None:
    sid = new_session_id()
    token = issue_token(SECRET, sid, 300, time.time())
    async with running(cluster) as relay:
        url = relay.url(sid, "ws").replace("http", "ws", 1)
        ws = await relay.http.ws_connect(
            url, protocols=("tokenrelay", f"tokenrelay.bearer.{token}")
        )
        try:
            assert ws.protocol == "tokenrelay"
            hello = json.loads((await ws.receive(timeout=10)).data)
            assert hello["type"] == "hello", hello
        finally:
            await ws.close()
        # ?token= is still taken (discouraged: a URL is logged), with no subprotocol
        ws = await relay.http.ws_connect(f"{url}?token={token}")
        try:
            assert ws.protocol is None
            assert json.loads((await ws.receive(timeout=10)).data)["type"] == "hello"
        finally:
            await ws.close()


@pytest.mark.parametrize(
    ("protocols", "reason"),
    [
        (lambda t: (f"tokenrelay.bearer.{t}",), "tokenrelay offered beside it"),
        (lambda t: ("tokenrelay", "tokenrelay.bearer."), "carries no token"),
        (lambda t: ("tokenrelay", f"tokenrelay.bearer.{t[:-4]}AAAA"), ""),
    ],
    ids=["without-tokenrelay", "empty", "forged"],
)
async def test_a_bad_token_subprotocol_is_refused_with_403_and_a_reason(
    cluster: ClusterInfo, protocols: object, reason: str
) -> None:
    sid = new_session_id()
    token = issue_token(SECRET, sid, 300, time.time())
    offered = protocols(token)  # type: ignore[operator]
    async with running(cluster) as relay:
        headers = {
            "Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
            "Sec-WebSocket-Protocol": ", ".join(offered),
        }  # fmt: skip
        async with relay.http.get(relay.url(sid, "ws"), headers=headers) as resp:
            body = await resp.json()
            assert resp.status == 403, body
            assert body["error"] == "token_invalid", body
            assert reason in body["reason"], body
            assert token not in json.dumps(body)


async def test_a_refused_subprotocol_token_does_not_fall_back_to_the_url() -> None:
    """The subprotocol comes before ``?token=``: a client that sends both means the first."""
    from aiohttp.test_utils import make_mocked_request

    from relay.protocol.auth import TokenInvalid
    from relay.service.tokens import request_token

    req = make_mocked_request(
        "GET", "/v1/sessions/s/ws?token=url-token",
        headers={"Sec-WebSocket-Protocol": "tokenrelay, tokenrelay.bearer.proto-token"},
    )  # fmt: skip
    assert request_token(req) == "proto-token"
    req = make_mocked_request(
        "GET", "/v1/sessions/s/ws?token=url-token",
        headers={"Sec-WebSocket-Protocol": "tokenrelay.bearer.proto-token"},
    )  # fmt: skip
    with pytest.raises(TokenInvalid):
        request_token(req)
    req = make_mocked_request(
        "GET", "/v1/sessions/s/ws", headers={
            "Authorization": "Bearer header-token",
            "Sec-WebSocket-Protocol": "tokenrelay, tokenrelay.bearer.proto-token",
        },
    )  # fmt: skip
    assert request_token(req) == "header-token"
