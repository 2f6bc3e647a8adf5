"""Hostile input against a real relay and a real worker: malformed and oversized JSON
bodies, wrong content types, hostile session ids, malformed resume offsets.

What each test checks, with the harness of :mod:`tests.support.hostile`: the status or
close code and the documented reason, a bystander session unharmed, no crash logged.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from yarl import URL

from relay.broker.rediscluster.publisher import read_backlog
from relay.protocol.frame import decode
from relay.protocol.keys import new_session_id
from tests.support.hostile import bystander, get_json, raw_http, stack, tok
from tests.support.relay import STEP, ws_frames
from tests.support.sse import SSEClient

pytestmark = pytest.mark.integration


# -- 1. malformed and oversized JSON bodies, wrong content types ------------------------


async def test_malformed_json_bodies_get_400_with_the_documented_error(cluster, redis):
    cases: list[tuple[bytes, str]] = [
        (b"", "malformed_json"),
        (b"{", "malformed_json"),
        (b'{"message": "hi",}', "malformed_json"),
        (b"\xff\xfe\x00{", "malformed_json"),
        (b'{"message": "\\ud800"}', "malformed_json"),  # lone surrogate
        (b'{"message": "hi", "max_tokens": NaN}', "malformed_json"),
        (b"[" * 5000 + b"]" * 5000, "malformed_json"),  # past orjson's depth limit
        (b"[]", "invalid_body"),
        (b'"hi"', "invalid_body"),
        (b"null", "invalid_body"),
        (b"12", "invalid_body"),
        (b'{"message": 5}', "invalid_message"),
        (b'{"message": ["hi"]}', "invalid_message"),
        (b'{"message": ""}', "invalid_message"),
        (b'{"message": " \\n\\t"}', "invalid_message"),
        (b'{"msg": "hi"}', "invalid_message"),
        (b'{"message": "hi", "system": 5}', "invalid_system"),
        (b'{"message": "hi", "max_tokens": true}', "invalid_max_tokens"),
        (b'{"message": "hi", "max_tokens": 0}', "invalid_max_tokens"),
        (b'{"message": "hi", "max_tokens": 5.5}', "invalid_max_tokens"),  # 5.0 is 5 (JSON)
        (b'{"message": "hi", "max_tokens": "5"}', "invalid_max_tokens"),
        (b'{"message": "hi", "max_tokens": 99999999999999999999999}', "invalid_max_tokens"),
        (b'{"message": "hi", "max_tokens": -1}', "invalid_max_tokens"),
    ]
    async with stack(cluster, redis) as env, bystander(env):
        sid, token = await env.worker.session()
        for raw, error in cases:
            status, body, _ = await env.worker.post_turn(
                sid, token, None, raw=raw, headers={"Content-Type": "application/json"}
            )
            assert (status, body.get("error")) == (400, error), (raw[:40], body)
            assert body["reason"]
        # the relay takes no body at all: any other method is the registration's 405
        for method in ("POST", "PUT", "DELETE"):
            async with env.relay.http.request(
                method, env.relay.url(sid), data=b'{"x":', headers={"Content-Type": "text/x"}
            ) as r:
                assert r.status == 405
                assert r.headers["Allow"] == "GET,OPTIONS"  # no HEAD on a stream


async def test_oversized_bodies_get_413(cluster, redis):
    async with stack(cluster, redis) as env, bystander(env):
        sid, token = await env.worker.session()
        big = b'{"message": "' + b"x" * 70_000 + b'"}'
        status, body, _ = await env.worker.post_turn(
            sid, token, None, raw=big, headers={"Content-Type": "application/json"}
        )
        assert (status, body["error"]) == (413, "body_too_large"), body

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked
            yield b'{"message": "'
            for _ in range(20):
                yield b"y" * 8192
            yield b'"}'

        assert env.worker.http is not None
        async with env.worker.http.post(
            env.worker.url(f"/v1/sessions/{sid}/turns"),
            data=chunks(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        ) as r:
            assert (r.status, (await r.json())["error"]) == (413, "body_too_large")
        # a Content-Length of a terabyte is refused before a byte of the body is read
        req = (
            f"POST /v1/sessions/{sid}/turns HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {10**12}\r\n\r\n{{"
        ).encode()
        status, raw = await raw_http(env.worker_port, req)
        assert status == 413, raw
        assert b"body_too_large" in raw
        for field, error in (("message", "message_too_large"), ("system", "system_too_large")):
            payload = {"message": "hi", field: "z" * 40_000}
            status, body, _ = await env.worker.post_turn(sid, token, payload)
            assert (status, body["error"]) == (413, error), body


async def test_wrong_content_types_get_415(cluster, redis):
    async with stack(cluster, redis) as env, bystander(env):
        sid, token = await env.worker.session()
        body = b'{"message": "hi"}'
        for ctype in (
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "application/octet-stream",
            "application/jsonx",
            "text/json",
            "application/json-seq",
            "",
        ):
            headers = {"Content-Type": ctype} if ctype else {}
            status, got, _ = await env.worker.post_turn(sid, token, None, raw=body, headers=headers)
            assert (status, got["error"]) == (415, "unsupported_media_type"), (ctype, got)
        # parameters do not matter: this one is a real turn
        status, got, _ = await env.worker.post_turn(
            sid, token, None, raw=body, headers={"Content-Type": "application/json; charset=utf-8"}
        )
        assert status == 202, got


# -- 2. session ids ---------------------------------------------------------------------

# Percent-encoded forms reach the app and get the JSON refusal; raw bytes that HTTP does
# not allow in a request line (NUL, non-ASCII, CR/LF) and request lines over 8190 bytes
# are refused by aiohttp's HTTP parser with a plain-text 400 before any handler runs.
BAD_IDS_APP = [
    "a%7Bb%7Dc",  # {b}
    "%7B%7D",
    "x%7D",
    "a%0D%0Ab",  # CR LF
    "a%0Ab",
    "a%00b",  # NUL
    "%00",
    "caf%C3%A9",  # non-ASCII
    "%E2%80%AE",  # right-to-left override
    "a%20b",
    "a.b",
    "..",
    "a%2F..%2Fb",
    "x" * 65,
    "x" * 7000,  # still fits in a request line
]
BAD_IDS_PARSER: list[bytes] = [
    b"a\x00b",
    "café".encode(),
    b"a{b}c",  # braces are legal in a request line: the app refuses them
    b"x" * 10_240,  # 10 KB: the request line is longer than 8190 bytes
]


async def test_hostile_session_ids_are_refused(cluster, redis):
    async with stack(cluster, redis) as env, bystander(env):
        relay, worker = env.relay, env.worker
        assert worker.http is not None
        for sid in BAD_IDS_APP:
            for path in ("events", "ws"):
                url = URL(f"{relay.base}/v1/sessions/{sid}/{path}", encoded=True)
                status, body = await get_json(relay.http, url, params={"token": "t"})
                assert (status, body["error"]) == (400, "invalid_session"), (sid, body)
                assert body["reason"].startswith("session id")
            url = URL(f"{worker.url('/')[:-1]}/v1/sessions/{sid}/turns", encoded=True)
            async with worker.http.post(url, json={"message": "hi"}) as r:
                got = await r.json()
                assert (r.status, got["error"]) == (400, "invalid_session"), (sid, got)
        for raw in BAD_IDS_PARSER:
            for port, method, tail in (
                (env.relay_port, b"GET", b"events"),
                (env.worker_port, b"POST", b"turns"),
            ):
                req = method + b" /v1/sessions/" + raw + b"/" + tail + b" HTTP/1.1\r\n"
                req += b"Host: x\r\nContent-Length: 0\r\n\r\n"
                status, text = await raw_http(port, req)
                assert status == 400, (raw[:20], text[:200])
                if raw == b"a{b}c":  # reached the app
                    assert b"invalid_session" in text, text
                elif len(raw) > 8190:
                    assert text.startswith(b"Got more than 8190 bytes"), text[:80]
                else:
                    assert text.startswith(b"Invalid char in url path"), text[:80]


# -- 8. Last-Event-ID / from: malformed and from the future -----------------------------

BAD_OFFSETS = [
    "-1",
    "abc",
    "1.5",
    "1e3",
    "0x10",
    "+5",
    "5 5",
    "5,6",
    "١٢",  # Arabic-Indic digits: str.isdigit() but not [0-9]
    "９",  # fullwidth
    "9" * 17,
    str(2**53),
    "1" * 7800,  # with the token, just under aiohttp's 8190-byte request line
]


async def test_malformed_resume_offsets_get_400_invalid_offset(cluster, redis):
    async with stack(cluster, redis) as env, bystander(env):
        relay = env.relay
        sid = new_session_id()
        t = tok(sid)
        for raw in BAD_OFFSETS:
            cases: list[tuple[str, dict[str, str], dict[str, str], str]] = [
                ("events", {"token": t, "last_event_id": raw}, {}, "last_event_id"),
                ("ws", {"token": t, "from": raw}, {}, "from"),
            ]
            if raw.isascii():
                cases.append(("events", {"token": t}, {"Last-Event-ID": raw}, "Last-Event-ID"))
            for path, params, headers, name in cases:
                status, body = await get_json(
                    relay.http, relay.url(sid, path), params=params, headers=headers
                )
                assert (status, body["error"]) == (400, "invalid_offset"), (raw[:20], path, body)
                assert body["reason"].startswith(name), body
        # the header wins over the query, even when the query is fine
        status, body = await get_json(
            relay.http,
            relay.url(sid),
            params={"token": t, "last_event_id": "3"},
            headers={"Last-Event-ID": "x"},
        )
        assert (status, body["error"]) == (400, "invalid_offset")
        # a NUL byte in a header never reaches the app
        req = f"GET /v1/sessions/{sid}/events?token={t} HTTP/1.1\r\nHost: x\r\n"
        status, raw_body = await raw_http(
            env.relay_port, req.encode() + b"Last-Event-ID: 5\x00\r\n\r\n"
        )
        assert status == 400
        assert raw_body.startswith(b"Invalid header value char"), raw_body


BAD_GENS = [
    "x" * 65,
    "a b",
    "g\u00e4",  # not ASCII
    "{x}",  # braces: a generation id is never a hash tag
    "../x",
    "a\x00b",
    "a\r\nb",
    "1" * 7800,
]


async def test_malformed_generations_get_400_invalid_gen(cluster, redis):
    async with stack(cluster, redis) as env, bystander(env):
        relay = env.relay
        sid = new_session_id()
        t = tok(sid)
        for raw in BAD_GENS:
            for path, extra in (("events", {"last_event_id": "3"}), ("ws", {"from": "3"})):
                status, body = await get_json(
                    relay.http, relay.url(sid, path), params={"token": t, "gen": raw, **extra}
                )
                assert (status, body["error"]) == (400, "invalid_gen"), (raw[:20], path, body)
                assert body["reason"].startswith("gen "), body


async def test_a_resume_offset_from_the_future_means_live_from_now(cluster, redis):
    """Documented behaviour: an offset past the session's last one (a client that
    remembers a session whose keys expired, or a lie) is served as "live from now":
    200, the hello echoes the asked offset, and the next frame is the session's next."""
    async with stack(cluster, redis) as env, bystander(env):
        relay, worker = env.relay, env.worker
        sid, token = await worker.session()
        status, body, _ = await worker.post_turn(sid, token, {"message": "one", "max_tokens": 6})
        assert status == 202, body
        async with asyncio.timeout(STEP):
            while (await read_backlog(redis, sid, 0, 1))[2] == 0 or not any(
                decode(x).kind == "done" for x in (await read_backlog(redis, sid, 0, 1000))[0]
            ):
                await asyncio.sleep(0.05)
        last = (await read_backlog(redis, sid, 0, 1000))[2]
        futures = [str(last + 1), str(last + 1000), str(2**53 - 1)]
        auth = {"Authorization": f"Bearer {token}"}
        streams: list[tuple[str, SSEClient | aiohttp.ClientWebSocketResponse]] = []
        resps: list[aiohttp.ClientResponse] = []
        try:
            for i, fut in enumerate(futures):
                kw: dict[str, Any] = (
                    {"headers": {**auth, "Last-Event-ID": fut}}
                    if i % 2 == 0
                    else {"headers": auth, "params": {"last_event_id": fut}}
                )
                r = await relay.http.get(relay.url(sid), **kw)
                assert r.status == 200, await r.text()
                resps.append(r)
                streams.append((fut, SSEClient(r)))
                ws = await relay.http.ws_connect(
                    relay.url(sid, "ws"), headers=auth, params={"from": fut}
                )
                hello = (await ws_frames(ws, 1))[0]
                assert hello["from"] == int(fut)
                streams.append((fut, ws))
            status, _, _ = await worker.post_turn(sid, token, {"message": "two", "max_tokens": 6})
            assert status == 202
            for fut, s in streams:
                offsets: list[int] = []
                if isinstance(s, SSEClient):
                    async with asyncio.timeout(STEP):
                        while True:
                            ev = await s.next_event()
                            assert ev is not None
                            offsets.append(int(ev[0]))
                            if ev[1] == "done":
                                break
                    assert s.hello is not None
                    assert s.hello["from"] == int(fut)
                else:
                    async with asyncio.timeout(STEP):
                        while True:
                            f = (await ws_frames(s, 1))[0]
                            offsets.append(f["offset"])
                            if f["kind"] == "done":
                                break
                # live from now: exactly the next turn's frames, from last + 1 on
                assert offsets == list(range(last + 1, last + 1 + len(offsets))), (fut, offsets)
        finally:
            for r in resps:
                r.close()
            for _, s in streams:
                if not isinstance(s, SSEClient):
                    await s.close()
