"""Hostile client addresses behind a trusted proxy: one client under several spellings of
its address (IPv4-mapped IPv6, with a port, in brackets), a whole IPv6 /64, and entries
that are no address at all (``203.000.113.009``). Per-address limits must count the
client once, and an entry the proxy vouches for but nobody can read is a 400 with the
documented body, never a bucket of its own.

The style of tests/hostile/test_hostile_access.py (a real relay and worker on the
suite's cluster, a bystander session that gets every frame, no crash logged).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.hostile.test_hostile_access import access_stack, mint, open_sse
from tests.hostile.test_hostile_access import refused as _refused
from tests.support.hostile import bystander

pytestmark = pytest.mark.integration


async def refused(resp: aiohttp.ClientResponse) -> tuple[int, str, str | None]:
    """The refusal's status, ``error`` and ``Retry-After``; a stream that was served
    instead is closed at once (its status says so) rather than read."""
    if resp.status == 200:
        resp.close()
        return 200, "", None
    return await _refused(resp)


SPELLINGS = ("203.0.113.7", "::ffff:203.0.113.7", "203.0.113.7:1234", "[::ffff:203.0.113.7]:80")
UNREADABLE = ("203.000.113.009", "203.0.113", "unknown", "1.2.3.4:99999")


async def test_one_client_under_four_spellings_holds_one_share_of_streams(cluster, redis):
    relay = {"trusted_proxies": "127.0.0.1", "max_streams_per_address": 3}
    async with access_stack(cluster, redis, relay=relay) as env, bystander(env):
        sid, write = await env.worker.session()
        tokens = [(await mint(env, sid, write, {"scope": "watch"}))[1]["token"] for _ in range(6)]
        held = [
            await open_sse(env, sid, t, {"X-Forwarded-For": s})
            for t, s in zip(tokens[:3], SPELLINGS[:3], strict=True)
        ]
        assert [r.status for r in held] == [200] * 3
        got = await refused(await open_sse(env, sid, tokens[3], {"X-Forwarded-For": SPELLINGS[3]}))
        assert got == (429, "too_many_streams", "5")
        # a /64 is one client: three addresses of it hold its share, the fourth is refused
        net = [f"2001:db8:7:7::{i}" for i in range(1, 5)]
        six = [await open_sse(env, sid, tokens[4], {"X-Forwarded-For": a}) for a in net[:3]]
        assert [r.status for r in six] == [200] * 3
        far = await refused(await open_sse(env, sid, tokens[5], {"X-Forwarded-For": net[3]}))
        assert far[:2] == (429, "too_many_streams")
        other = await open_sse(env, sid, tokens[5], {"X-Forwarded-For": "2001:db8:7:8::1"})
        assert other.status == 200  # the next /64 is another client
        for r in [*held, *six, other]:
            r.close()


async def test_an_unreadable_address_from_a_trusted_proxy_is_a_400(cluster, redis):
    trusted = {"trusted_proxies": "127.0.0.1"}
    async with access_stack(cluster, redis, relay=trusted, worker=trusted) as env, bystander(env):
        sid, write = await env.worker.session()
        http = env.worker.http
        assert http is not None
        for hop in UNREADABLE:
            headers = {"X-Forwarded-For": f"198.51.100.4, {hop}"}
            status, error, _ = await refused(await open_sse(env, sid, write, headers))
            assert (status, error) == (400, "invalid_forwarded_for"), hop
            async with http.post(env.worker.url("/v1/sessions"), headers=headers) as r:
                body: dict[str, Any] = await r.json()
                assert (r.status, body["error"]) == (400, "invalid_forwarded_for"), hop
                assert "X-Forwarded-For" in body["reason"]
        # junk a client put left of its own address is never read
        fine = await open_sse(env, sid, write, {"X-Forwarded-For": "203.000.113.009, 198.51.100.4"})
        assert fine.status == 200
        fine.close()


async def test_session_creation_counts_an_ipv6_network_as_one_address(cluster, redis):
    worker = {"trusted_proxies": "127.0.0.1", "session_rate_per_s": 0.2, "session_burst": 5}
    async with access_stack(cluster, redis, worker=worker) as env, bystander(env):
        http = env.worker.http
        assert http is not None
        statuses = []
        for i in range(1, 11):  # ten addresses of one /64
            xff = {"X-Forwarded-For": f"2001:db8:aa:bb::{i:x}"}
            async with http.post(env.worker.url("/v1/sessions"), headers=xff) as r:
                statuses.append(r.status)
        assert statuses == [201] * 5 + [429] * 5
        xff = {"X-Forwarded-For": "2001:db8:aa:bc::1"}
        async with http.post(env.worker.url("/v1/sessions"), headers=xff) as r:
            assert r.status == 201
