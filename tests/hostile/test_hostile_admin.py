"""The operator's endpoints and the gateway key against a real relay and a real worker:
``/metrics`` (relay, worker) and ``/v1/router`` (worker) answer the admin key or a local
request without one, name no session and label no engine by its address; a gateway key
(the operator's key for session-less completions and jobs) cannot write into a session.

The style of tests/hostile/test_hostile_access.py (the suite's cluster, a bystander
session that gets every frame, no crash logged).
"""

from __future__ import annotations

import json
import re
from typing import Any

import aiohttp
import pytest

from relay.broker.rediscluster.publisher import read_backlog
from tests.hostile.test_hostile_access import access_stack
from tests.support.hostile import Env, bystander

pytestmark = pytest.mark.integration

ADMIN = "admin-key-for-tests-5c1e9a7f3b2d8e4a6c0f"
GATEWAY = "gateway-key-for-tests-0123456789"


async def _get(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any] | str, str | None]:
    async with http.get(url, headers=headers or {}) as r:
        text = await r.text()
        try:
            body: dict[str, Any] | str = json.loads(text)
        except ValueError:
            body = text
        return r.status, body, r.headers.get("WWW-Authenticate")


def _urls(env: Env) -> list[tuple[aiohttp.ClientSession, str]]:
    assert env.worker.http is not None
    return [
        (env.relay.http, env.relay.base + "/metrics"),
        (env.worker.http, env.worker.url("/metrics")),
        (env.worker.http, env.worker.url("/v1/router")),
    ]


async def test_with_an_admin_key_the_operators_endpoints_need_it(cluster, redis):
    admin = {"admin_key": ADMIN}
    async with access_stack(cluster, redis, relay=admin, worker=admin) as env, bystander(env):
        for http, url in _urls(env):
            status, body, realm = await _get(http, url)
            assert status == 401, url
            assert isinstance(body, dict)
            assert body["error"] == "admin_key_missing"
            assert realm is not None
            assert "TOKENRELAY_ADMIN_KEY" in body["reason"]
            for wrong in (f"Bearer {ADMIN[:-1]}x", f"Bearer {GATEWAY}", f"Basic {ADMIN}"):
                status, body, _ = await _get(http, url, {"Authorization": wrong})
                assert isinstance(body, dict)
                allowed = ((403, "admin_key_invalid"), (401, "admin_key_missing"))
                assert (status, body["error"]) in allowed, (url, wrong)
            status, _, _ = await _get(http, url, {"Authorization": f"Bearer {ADMIN}"})
            assert status == 200, url


async def test_without_an_admin_key_only_local_unforwarded_requests_are_served(cluster, redis):
    async with access_stack(cluster, redis) as env, bystander(env):
        for http, url in _urls(env):
            status, _, _ = await _get(http, url)
            assert status == 200, url  # the test is a local client
            for proxied in ({"X-Forwarded-For": "203.0.113.9"}, {"Forwarded": "for=203.0.113.9"}):
                status, body, _ = await _get(http, url, proxied)
                assert isinstance(body, dict)
                assert (status, body["error"]) == (403, "admin_loopback_only"), url
                assert "--admin-key" in body["reason"]


async def test_router_and_metrics_name_no_session_and_no_engine_address(cluster, redis):
    async with access_stack(cluster, redis) as env, bystander(env) as b:
        sid, token = await env.worker.session()
        status, body, _ = await env.worker.post_turn(sid, token, {"message": "where am I?"})
        assert status == 202, body
        assert env.worker.http is not None
        _, router, _ = await _get(env.worker.http, env.worker.url("/v1/router"))
        assert isinstance(router, dict)
        assert router["placements"], router
        text = json.dumps(router)
        for secret in (sid, b.sid):
            assert secret not in text
        assert all(re.fullmatch(r"[0-9a-f]{8}", p["point"]) for p in router["placements"])
        _, metrics, _ = await _get(env.worker.http, env.worker.url("/metrics"))
        assert isinstance(metrics, str)
        for engine in env.worker.engines:
            assert engine.url.split("//", 1)[1].split("/", 1)[0] not in metrics
        assert 'engine_in_flight{engine="eng-0"}' in metrics  # named engines keep their id


async def _complete(
    env: Env, bearer: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    http = env.worker.http
    assert http is not None
    hdrs = {"Authorization": f"Bearer {bearer}", **(headers or {})}
    async with http.post(env.worker.url("/v1/chat/completions"), json=body, headers=hdrs) as r:
        return r.status, await r.json()


async def test_a_gateway_key_cannot_write_into_a_session(cluster, redis):
    worker = {"gateway_keys": (GATEWAY,)}
    async with access_stack(cluster, redis, worker=worker) as env, bystander(env):
        sid, token = await env.worker.session()
        msg = {"model": "tokenrelay-mock", "max_tokens": 4,
               "messages": [{"role": "user", "content": "write here"}]}  # fmt: skip
        for body, headers in (({**msg, "user": f"session:{sid}"}, None),
                              (msg, {"X-Session-Id": sid})):  # fmt: skip
            status, got = await _complete(env, GATEWAY, body, headers)
            assert status == 403, got
            assert got["error"]["code"] == "session_token_required"
        raw, _, last = await read_backlog(redis, sid, 0, 100)
        assert (raw, last) == ([], 0)  # nothing was written into the session
        # the key still serves session-less completions, the session's token its session
        status, got = await _complete(env, GATEWAY, msg)
        assert status == 200, got
        status, got = await _complete(env, token, {**msg, "user": f"session:{sid}"})
        assert status == 200, got
        other, _ = await env.worker.session()  # its token names another session
        status, got = await _complete(env, token, {**msg, "user": f"session:{other}"})
        assert (status, got["error"]["code"]) == (403, "token_wrong_session")
        status, got = await _complete(env, token, msg)  # a session token is no gateway key
        assert status == 401, got
        raw, _, _ = await read_backlog(redis, sid, 0, 100)
        assert json.loads(raw[0])["kind"] == "meta"
