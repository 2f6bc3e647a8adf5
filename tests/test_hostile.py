"""Hostile input against a real relay and a real worker.

Every test runs a relay app (``relay.edge.server.make_app``, 127.0.0.1, port 0) and a worker
app (``tests.worker_harness.Harness``: mock engines from ``devstack.mockengine.server``
in-process) on the session's real Redis Cluster, throws one kind of hostile input at
them and checks:

- the status / close code AND the documented ``error`` / reason (docs/PROTOCOL.md,
  the hostile-input table of RELIABILITY.md);
- a well-behaved session (:class:`Bystander`: created on the worker, watched over SSE
  on the relay, one turn posted before the hostile input and one after) receives every
  frame of both turns, in order, and only its own;
- both apps still answer ``/healthz`` afterwards, and nothing was logged as an
  unhandled exception (a 500 or a crashed handler).

The connection burst runs the relay as a subprocess (``tokenrelay relay``) so that its
file descriptors can be counted in ``/proc/<pid>/fd``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import resource
import socket
import struct
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import orjson
import pytest
from aiohttp import WSMsgType
from aiohttp.http_exceptions import HttpProcessingError
from yarl import URL

from devstack.cluster.launcher import ClusterInfo
from relay.protocol.auth import issue_token
from relay.protocol.frame import decode
from relay.protocol.keys import new_session_id
from relay.redisio.publisher import Publisher, read_backlog
from tests.test_server import STEP, Relay, SSEClient, running, wait_ready, ws_frames
from tests.worker_harness import SECRET, Harness

pytestmark = pytest.mark.integration


# -- the stack and the well-behaved session ---------------------------------------------


@dataclass
class Env:
    relay: Relay
    worker: Harness
    redis: Any

    @property
    def relay_port(self) -> int:
        return int(self.relay.base.rsplit(":", 1)[1])

    @property
    def worker_port(self) -> int:
        return int(self.worker.url("/").split(":")[2].split("/")[0])

    async def healthy(self) -> None:
        async with self.relay.http.get(self.relay.base + "/healthz") as r:
            assert r.status == 200, await r.text()
        assert self.worker.http is not None
        async with self.worker.http.get(self.worker.url("/healthz")) as r:
            assert r.status == 200, await r.text()


class _Crashes(logging.Handler):
    """Collects records that mean a crash: an unhandled exception in a handler (aiohttp
    logs it as "Error handling request" / "Unhandled exception" with the exception; a
    malformed request line or header is the HTTP parser's 400, not a crash) or any
    ERROR of the relay / worker loggers."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):  # the parser's 400: expected here
            return
        if record.name.startswith(("relay", "worker", "aiohttp")):
            self.records.append(record)


@contextlib.contextmanager
def no_crash() -> Iterator[_Crashes]:
    h = _Crashes()
    root = logging.getLogger()
    root.addHandler(h)
    try:
        yield h
    finally:
        root.removeHandler(h)
    assert not h.records, [(r.name, r.getMessage(), r.exc_info) for r in h.records]


@asynccontextmanager
async def stack(cluster: ClusterInfo, redis: Any, **relay_overrides: Any) -> AsyncIterator[Env]:
    harness = Harness(redis)
    try:
        with no_crash():
            await harness.start_engines(2, decode_tok_per_s=300.0)
            await harness.start_worker()
            async with running(cluster, **relay_overrides) as relay:
                env = Env(relay, harness, redis)
                yield env
                await env.healthy()
    finally:
        await harness.stop()


class Bystander:
    """A well-behaved session alongside the hostile input: created on the worker,
    watched over SSE from offset 0 on the relay; :meth:`start` posts turn 1, :meth:`check`
    posts turn 2 and asserts the stream held every frame of both turns (offsets
    1..n exactly as in the backlog, every frame of this session, text as stored)."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.sid = ""
        self.token = ""
        self._resp: aiohttp.ClientResponse | None = None
        self.client: SSEClient | None = None
        self.got: list[tuple[int, str, dict[str, Any]]] = []

    async def start(self) -> Bystander:
        self.sid, self.token = await self.env.worker.session()
        relay = self.env.relay
        self._resp = await relay.http.get(
            relay.url(self.sid),
            headers={"Authorization": f"Bearer {self.token}"},
            params={"last_event_id": "0"},
        )
        assert self._resp.status == 200, await self._resp.text()
        self.client = SSEClient(self._resp)
        await self._post("turn one")
        return self

    async def _post(self, message: str) -> None:
        status, body, _ = await self.env.worker.post_turn(
            self.sid, self.token, {"message": message, "max_tokens": 24}
        )
        assert status == 202, body

    async def _until_done(self) -> None:
        assert self.client is not None
        async with asyncio.timeout(STEP * 2):
            while True:
                ev = await self.client.next_event()
                assert ev is not None, "the bystander's stream ended"
                ident, kind, data = ev
                self.got.append((int(ident), kind, data))
                if kind in ("done", "error"):
                    return

    async def check(self) -> None:
        await self._until_done()
        await self._post("turn two")
        await self._until_done()
        raw, _, last = await read_backlog(self.env.redis, self.sid, 0, 10_000)
        stored = [decode(x) for x in raw]
        offsets = [o for o, _, _ in self.got]
        assert offsets == list(range(1, last + 1)) == [f.offset for f in stored]
        assert all(d["session"] == self.sid for _, _, d in self.got)
        assert [k for _, k, _ in self.got if k in ("done", "error")] == ["done", "done"]
        text = "".join(d.get("text", "") for _, k, d in self.got if k == "token")
        assert text == "".join(f.text for f in stored if f.kind == "token")
        assert text

    async def close(self) -> None:
        if self._resp is not None:
            self._resp.close()


@asynccontextmanager
async def bystander(env: Env) -> AsyncIterator[Bystander]:
    b = await Bystander(env).start()
    try:
        yield b
        await b.check()
    finally:
        await b.close()


def tok(sid: str, **kw: Any) -> str:
    secret = kw.pop("secret", SECRET)
    return issue_token(secret, sid, kw.pop("ttl", 300), kw.pop("now", time.time()), **kw)


async def raw_http(port: int, request: bytes, timeout_s: float = STEP) -> tuple[int, bytes]:
    """Send raw bytes, read the whole response; (status, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(timeout_s):
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            body = await reader.readexactly(length) if length else b""
        return status, body
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def get_json(
    http: aiohttp.ClientSession, url: str | URL, **kw: Any
) -> tuple[int, dict[str, Any]]:
    async with http.get(url, **kw) as r:
        body = await r.json(content_type=None) if r.status != 200 else {}
        return r.status, body


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
        # the relay takes no body at all: any other method is aiohttp's 405
        for method in ("POST", "PUT", "DELETE"):
            async with env.relay.http.request(
                method, env.relay.url(sid), data=b'{"x":', headers={"Content-Type": "text/x"}
            ) as r:
                assert r.status == 405
                assert r.headers["Allow"] == "GET,HEAD,OPTIONS"


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
                assert (status, body["error"]) == (400, "bad_session"), (sid, body)
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
                    assert b"bad_session" in text or b"invalid_session" in text, text
                elif len(raw) > 8190:
                    assert text.startswith(b"Got more than 8190 bytes"), text[:80]
                else:
                    assert text.startswith(b"Invalid char in url path"), text[:80]


# -- 3. tokens --------------------------------------------------------------------------


def _flip(token: str, i: int) -> str:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    c = token[i]
    if c == ".":
        return token
    return token[:i] + alphabet[(alphabet.index(c) + 1) % 64] + token[i + 1 :]


OTHER_SECRET = "not-the-secret-but-as-strong-3f9a1c7e5b2d"


def _jwt(sid: str, header: dict[str, Any]) -> str:
    """A token signed with the real secret but a hostile header (``None`` drops a field)."""
    now = int(time.time())
    claims = {"sub": sid, "scope": "write", "iat": now, "exp": now + 300}
    head = {k: v for k, v in {"alg": "HS256", "kid": "k1", **header}.items() if v is not None}
    if head["alg"] == "none":
        b64 = base64.urlsafe_b64encode
        parts = [b64(orjson.dumps(x)).rstrip(b"=").decode() for x in (head, claims)]
        return ".".join([*parts, ""])
    extra = {k: v for k, v in head.items() if k != "alg"}
    key = SECRET * 2 if head["alg"] == "HS512" else SECRET  # HS512 wants 64 bytes
    token: str = jwt.encode(claims, key, algorithm=head["alg"], headers=extra)
    if "kid" not in head:  # PyJWT keeps no kid unless given one; make sure
        assert "kid" not in jwt.get_unverified_header(token)
    return token


def bad_tokens(sid: str, other: str) -> list[tuple[dict[str, str], dict[str, str], int, str]]:
    """(query, headers, status, error) for every kind of wrong token."""
    good = tok(sid)
    bearer = "Authorization"
    return [
        ({}, {}, 401, "token_missing"),
        ({"token": ""}, {}, 401, "token_missing"),
        ({"token": tok(sid, secret=OTHER_SECRET)}, {}, 403, "token_invalid"),  # forged, kid k1
        ({"token": _jwt(sid, {"alg": "none"})}, {}, 403, "token_invalid"),  # alg none
        ({"token": _jwt(sid, {"alg": "HS512"})}, {}, 403, "token_invalid"),  # not the key's alg
        ({"token": _jwt(sid, {"kid": "k9"})}, {}, 403, "token_unknown_key"),
        ({"token": _jwt(sid, {"kid": None})}, {}, 403, "token_unknown_key"),  # no kid at all
        ({"token": "abc.def"}, {}, 403, "token_invalid"),
        ({"token": good[:-3]}, {}, 403, "token_invalid"),  # truncated
        ({"token": _flip(good, 5)}, {}, 403, "token_invalid"),  # payload bit flip
        ({"token": _flip(good, len(good) - 2)}, {}, 403, "token_invalid"),  # signature flip
        ({"token": good + "." + good}, {}, 403, "token_invalid"),
        ({"token": "A" * 5000}, {}, 403, "token_invalid"),
        ({"token": good + "\x00"}, {}, 403, "token_invalid"),
        ({"token": good + "\r\n"}, {}, 403, "token_invalid"),
        ({}, {bearer: "Basic eDp5"}, 403, "token_invalid"),
        ({}, {bearer: f"Bearer {good} {good}"}, 403, "token_invalid"),
        ({}, {bearer: "Bearer"}, 403, "token_invalid"),
        ({"token": good}, {bearer: "Bearer junk"}, 403, "token_invalid"),  # the header wins
        ({"token": tok(sid, ttl=1, now=time.time() - 60)}, {}, 403, "token_expired"),
        ({"token": tok(sid, now=time.time() + 3600)}, {}, 403, "token_not_yet_valid"),
        ({"token": tok(other)}, {}, 403, "token_wrong_session"),
        ({}, {bearer: f"Bearer {tok(other, scope='write')}"}, 403, "token_wrong_session"),
    ]


async def test_forged_expired_and_other_session_tokens_are_refused(cluster, redis):
    async with stack(cluster, redis) as env, bystander(env) as b:
        relay, worker = env.relay, env.worker
        sid, other = new_session_id(), b.sid
        for query, headers, status, error in bad_tokens(sid, other):
            for path in ("events", "ws"):
                got, body = await get_json(
                    relay.http, relay.url(sid, path), params=query, headers=headers
                )
                assert (got, body["error"]) == (status, error), (path, query, headers, body)
                assert body["reason"]
        wsid, _ = await worker.session()
        for query, headers, status, error in bad_tokens(wsid, other):
            assert worker.http is not None
            async with worker.http.post(
                worker.url(f"/v1/sessions/{wsid}/turns"),
                params=query,
                headers=headers,
                json={"message": "hi"},
            ) as r:
                body = await r.json()
                assert (r.status, body["error"]) == (status, error), (query, headers, body)
        # a watch-scope token may watch but not write
        status, body, _ = await worker.post_turn(wsid, tok(wsid), {"message": "hi"})
        assert (status, body["error"]) == (403, "token_wrong_scope")
        # a token longer than a header line: the HTTP parser's 400
        req = f"GET /v1/sessions/{sid}/events HTTP/1.1\r\nHost: x\r\n"
        req += "Authorization: Bearer " + "A" * 9000 + "\r\n\r\n"
        status, long_body = await raw_http(env.relay_port, req.encode())
        assert status == 400
        assert long_body.startswith(b"Got more than 8190 bytes"), long_body[:80]


# -- 4. cross-session reads -------------------------------------------------------------


def _pct(text: str) -> str:
    return "".join(f"%{b:02X}" for b in text.encode())


async def test_a_token_of_one_session_never_reads_another(cluster, redis):
    async with stack(cluster, redis) as env, bystander(env) as b:
        relay, worker = env.relay, env.worker
        a_sid, a_tok = await worker.session()
        victim = b.sid  # has frames in its backlog and a live turn
        variants = [
            victim,
            _pct(victim),
            _pct(victim).lower(),
            "{" + victim + "}",
            "%7B" + victim + "%7D",
            f"{a_sid}%2F..%2F{victim}",
            f"..%2F{victim}",
            f"{victim}%00",
            f"{victim}%0D%0A",
            f"{victim}%20",
            f"{a_sid}{victim}",
            victim.swapcase(),
        ]
        seen: list[int] = []
        for v in variants:
            for path in ("events", "ws"):
                for auth in (
                    {"params": {"token": a_tok}},
                    {"headers": {"Authorization": f"Bearer {a_tok}"}},
                ):
                    url = URL(f"{relay.base}/v1/sessions/{v}/{path}", encoded=True)
                    params = {**auth.get("params", {}), "last_event_id": "0", "from": "0"}
                    status, body = await get_json(
                        relay.http, url, params=params, headers=auth.get("headers", {})
                    )
                    seen.append(status)
                    assert status in (400, 403), (v, path, status, body)
                    assert body["error"] in ("bad_session", "token_wrong_session"), body
            assert worker.http is not None
            url = URL(f"{worker.url('/')[:-1]}/v1/sessions/{v}/turns", encoded=True)
            async with worker.http.post(
                url, json={"message": "hi"}, headers={"Authorization": f"Bearer {a_tok}"}
            ) as r:
                assert r.status in (400, 403), (v, await r.text())
        assert 403 in seen
        assert 400 in seen
        # path traversal sent as is (no client normalisation): no route matches
        for raw_path in (
            f"/v1/sessions/{a_sid}/../{victim}/events",
            f"/v1/sessions/{victim}/events/../../{a_sid}/events",
            f"//v1/sessions/{victim}/events",
            f"/v1/sessions/{a_sid}/events/../../{victim}/events",
        ):
            req = f"GET {raw_path}?token={a_tok}&last_event_id=0 HTTP/1.1\r\nHost: x\r\n\r\n"
            status, _ = await raw_http(env.relay_port, req.encode())
            assert status in (400, 403, 404), (raw_path, status)
        # and the rightful path gives A's frames only
        status, body, _ = await worker.post_turn(a_sid, a_tok, {"message": "mine", "max_tokens": 8})
        assert status == 202, body
        async with relay.http.get(
            relay.url(a_sid), params={"token": a_tok, "last_event_id": "0"}
        ) as r:
            assert r.status == 200
            client = SSEClient(r)
            async with asyncio.timeout(STEP):
                while True:
                    ev = await client.next_event()
                    assert ev is not None
                    assert ev[2]["session"] == a_sid
                    if ev[1] == "done":
                        break


# -- 5. WebSocket garbage and oversized frames ------------------------------------------


def _ws_handshake(sid: str, token: str) -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return (
        f"GET /v1/sessions/{sid}/ws?token={token} HTTP/1.1\r\nHost: x\r\n"
        "Upgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()


def _masked(opcode_byte: int, payload: bytes, length_field: bytes | None = None) -> bytes:
    mask = os.urandom(4)
    body = bytes(c ^ mask[i % 4] for i, c in enumerate(payload))
    if length_field is None:
        n = len(payload)
        length_field = (
            bytes([0x80 | n])
            if n < 126
            else bytes([0x80 | 126]) + struct.pack(">H", n)
            if n < 65536
            else bytes([0x80 | 127]) + struct.pack(">Q", n)
        )
    return bytes([opcode_byte]) + length_field + mask + body


async def _raw_ws_close(port: int, sid: str, token: str, payload: bytes) -> tuple[int, bytes]:
    """Handshake by hand, read the hello, send ``payload``; the server's close (code,
    reason). Frames before the close are skipped."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_ws_handshake(sid, token))
        await writer.drain()
        async with asyncio.timeout(STEP):
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 101"), head
            writer.write(payload)
            await writer.drain()
            while True:
                b0, b1 = await reader.readexactly(2)
                n = b1 & 0x7F
                if n == 126:
                    n = struct.unpack(">H", await reader.readexactly(2))[0]
                elif n == 127:
                    n = struct.unpack(">Q", await reader.readexactly(8))[0]
                data = await reader.readexactly(n)
                if b0 & 0x0F == 0x8:
                    return struct.unpack(">H", data[:2])[0], data[2:]
    finally:
        writer.close()


async def test_websocket_garbage_and_oversized_frames_get_close_codes(cluster, redis):
    async with (
        stack(cluster, redis, ws_max_message_bytes=256) as env,
        bystander(env) as b,
    ):
        relay = env.relay
        sid = new_session_id()
        t = tok(sid)
        # through a client library: messages the protocol does not allow
        cases: list[tuple[str | bytes, int, str]] = [
            ("not json", 4400, 'client messages must be {"type":"ping"}'),
            ('{"type":"subscribe","session":"' + b.sid + '"}', 4400, "client messages must be"),
            ('{"type":"ping","pad":"' + "x" * 80 + '"}', 4400, "client messages must be"),
            ("[1,2]", 4400, "client messages must be"),
            (b"\x00\x01\x02", 1003, "binary messages are not supported"),
            ("x" * 1000, 1009, ""),
        ]
        for payload, code, reason in cases:
            async with relay.http.ws_connect(relay.url(sid, "ws"), params={"token": t}) as ws:
                assert (await ws_frames(ws, 1))[0]["type"] == "hello"
                await ws.send_str('{"type":"ping"}')  # ignored
                if isinstance(payload, bytes):
                    await ws.send_bytes(payload)
                else:
                    await ws.send_str(payload)
                msg = await asyncio.wait_for(ws.receive(), STEP)
                assert msg.type is WSMsgType.CLOSE, msg
                assert msg.data == code, (payload, msg)
                assert (msg.extra or "").startswith(reason), msg
        # raw frames no client library would send
        hello = b'{"type":"ping"}'
        raw_cases: list[tuple[bytes, int]] = [
            (bytes([0xF1]) + bytes([0x80 | 5]) + b"abcd" + b"hello", 1002),  # RSV bits set
            (_masked(0x83, b""), 1002),  # reserved opcode 3
            (_masked(0x81, b"", bytes([0x80 | 127]) + struct.pack(">Q", 2**63 - 1)), 1009),
            (_masked(0x81, b"\xff\xfe"), 1007),  # text that is not UTF-8
            (_masked(0x01, b"a" * 200) + _masked(0x80, b"b" * 200), 1009),  # fragments add up
            (_masked(0x89, b"p" * 126, bytes([0x80 | 126]) + struct.pack(">H", 126)), 1002),
            (b"\xff" * 64, 1002),
            (_masked(0x81, hello) + b"\x81\x05hello", 4400),  # unmasked: read as text
        ]
        for payload, code in raw_cases:
            got, _reason = await _raw_ws_close(env.relay_port, sid, t, payload)
            assert got == code, (payload[:8], got, _reason)
        async with asyncio.timeout(STEP):
            while len(relay.server.streams) > 1:  # only the bystander's
                await asyncio.sleep(0.02)
        closes = relay.server.metrics.closes
        assert closes.labels("ws", "bad_message")._value.get() >= 4
        assert closes.labels("ws", "binary")._value.get() == 1
        assert closes.labels("ws", "internal")._value.get() == 0


# -- 6. slowloris: an SSE reader that never reads ---------------------------------------


async def test_an_sse_reader_that_never_reads_is_cut_without_stalling_others(cluster, redis):
    limits = {"write_timeout_s": 0.5, "queue_frames": 64, "hard_limit_frames": 256}
    async with stack(cluster, redis, **limits) as env, bystander(env):
        relay = env.relay
        sid = new_session_id()
        t = tok(sid)
        # two good watchers of the SAME session as the slow one
        sse_resp = await relay.http.get(relay.url(sid), params={"token": t})
        assert sse_resp.status == 200
        good_sse = SSEClient(sse_resp)
        good_ws = await relay.http.ws_connect(relay.url(sid, "ws"), params={"token": t})
        await ws_frames(good_ws, 1)
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(slow, ("127.0.0.1", env.relay_port))
        await loop.sock_sendall(
            slow, f"GET /v1/sessions/{sid}/events?token={t} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        )
        got_sse: list[int] = []
        got_ws: list[int] = []

        async def read_sse() -> None:
            while True:
                ev = await good_sse.next_event()
                assert ev is not None
                got_sse.append(int(ev[0]))
                if ev[1] == "done":
                    return

        async def read_ws() -> None:
            while True:
                msg = await good_ws.receive()
                assert msg.type is WSMsgType.TEXT, msg
                f = msg.json()
                got_ws.append(f["offset"])
                if f["kind"] == "done":
                    return

        readers = [asyncio.create_task(read_sse()), asyncio.create_task(read_ws())]
        try:
            async with asyncio.timeout(STEP):
                while len(relay.server.streams) < 4:  # bystander + 2 good + slow
                    await asyncio.sleep(0.01)
            gen = await Publisher(redis).open_generation(sid)
            pad = "x" * 20_000
            m = relay.server.metrics
            started = time.monotonic()
            published = 0
            async with asyncio.timeout(STEP * 2):
                while m.closes.labels("sse", "slow_consumer")._value.get() < 1:
                    await gen.meta({"pad": pad})
                    published += 1
                    if published % 16 == 0:
                        await asyncio.sleep(0)  # let the readers run
            cut_after = time.monotonic() - started
            last = await gen.done()
            async with asyncio.timeout(STEP):
                await asyncio.gather(*readers)
            assert got_sse == got_ws == list(range(1, last + 1))
            assert len(relay.server.streams) == 3  # the slow one is gone
            assert cut_after < STEP
        finally:
            for r in readers:
                r.cancel()
            slow.close()
            sse_resp.close()
            await good_ws.close()


# -- 7. 10,000 connection attempts in a burst -------------------------------------------


def _fds(pid: int) -> tuple[int, int]:
    """(all open fds, sockets accepted on ``port``-less listeners i.e. client connections)
    of process ``pid``: the second counts TCP sockets whose local port is a listening
    port of the process (HTTP clients), the rest are Redis connections, files, pipes."""
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    names = os.listdir(fd_dir)
    for name in names:
        with contextlib.suppress(OSError):
            link = os.readlink(f"{fd_dir}/{name}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    rows = []
    with open(f"/proc/{pid}/net/tcp") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            rows.append((int(parts[1].split(":")[1], 16), parts[3], parts[9]))
    listening = {port for port, state, ino in rows if state == "0A" and ino in inodes}
    clients = sum(1 for port, state, ino in rows if port in listening and state != "0A"
                  and ino in inodes)  # fmt: skip
    return len(names), clients


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RelayProcess:
    proc: asyncio.subprocess.Process
    base: str
    port: int
    log_path: Path


@asynccontextmanager
async def relay_process(
    cluster: ClusterInfo, log_dir: Path, relay_id: str, *flags: str
) -> AsyncIterator[RelayProcess]:
    """``tokenrelay relay`` as a subprocess (so that its fds can be counted), ready to
    serve; stopped by pid on the way out; its log must hold no traceback. The log goes
    to a file, not a pipe: a pipe nobody drains fills up, blocks the relay's event loop
    on a log write, and makes ``proc.wait()`` wait for the pipe forever."""
    port = _free_port()
    log_path = log_dir / f"{relay_id}.log"
    with open(log_path, "wb") as log_file:  # noqa: ASYNC230 (a local file, opened once)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tokenrelay", "relay", "--port", str(port),
            "--redis", cluster.url, "--secret", SECRET, "--relay-id", relay_id,
            "--log-level", "INFO", *flags,
            stdout=asyncio.subprocess.DEVNULL, stderr=log_file,
        )  # fmt: skip
    relay = RelayProcess(proc, f"http://127.0.0.1:{port}", port, log_path)
    try:
        async with aiohttp.ClientSession() as http:
            await wait_ready(http, relay.base, 30)
        yield relay
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()
    err = log_path.read_bytes()
    print(f"relay log: {len(err)} bytes, {err.count(b'Traceback')} tracebacks")
    assert b"Traceback" not in err, _tail(log_path)


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_bytes()[-n:].decode(errors="replace")


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_ten_thousand_connection_attempts_in_a_burst(cluster, redis, tmp_path):
    attempts, window, max_conn = 10_000, 1_000, 200
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = window * 2 + 512
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(need, soft), hard), hard))
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < need:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {need}")
    sid = new_session_id()
    t = tok(sid)
    # one token, one address for every attempt: this measures the relay's capacity, so
    # the per-token and per-address limits (tests/test_hostile_access.py) are lifted
    flags = ("--max-connections", str(max_conn), "--heartbeat-s", "1",
             "--max-streams-per-address", "0", "--max-streams-per-token", "0")  # fmt: skip
    async with (
        relay_process(cluster, tmp_path, "edge-burst", *flags) as relay,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http,
    ):
        proc, base, port, log_path = relay.proc, relay.base, relay.port, relay.log_path
        # warm up: one stream, so the relay's Redis connections exist before counting
        async with http.get(base + f"/v1/sessions/{sid}/events", params={"token": t}) as r:
            assert r.status == 200
            await r.content.readline()
        await asyncio.sleep(1.5)
        before = _fds(proc.pid)

        outcomes: dict[str, int] = {}
        sem = asyncio.Semaphore(window)
        requests = [
            b"",  # connect and hang up
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
            f"GET /v1/sessions/{sid}/events?token={t} HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
            b"GET /v1/sessions/%7Bx%7D/events HTTP/1.1\r\nHost: x\r\n\r\n",
            b"GET /v1/sessio",  # half a request line, then hang up
        ]

        async def attempt(i: int) -> None:
            req = requests[i % len(requests)]
            async with sem:
                key = "?"
                writer = None
                try:
                    async with asyncio.timeout(10):
                        reader, writer = await asyncio.open_connection("127.0.0.1", port)
                        if not req or not req.endswith(b"\r\n\r\n"):
                            writer.write(req)
                            key = "hung_up"
                        else:
                            writer.write(req)
                            line = await reader.readline()
                            key = line.split(b" ")[1].decode() if line else "eof"
                except TimeoutError:
                    key = "timeout"
                except OSError as exc:
                    key = type(exc).__name__
                finally:
                    if writer is not None:
                        writer.close()
                outcomes[key] = outcomes.get(key, 0) + 1

        started = time.monotonic()
        async with asyncio.timeout(180):
            await asyncio.gather(*(attempt(i) for i in range(attempts)))
        took = time.monotonic() - started
        assert sum(outcomes.values()) == attempts
        assert proc.returncode is None, "the relay died"
        served = outcomes.get("200", 0) + outcomes.get("503", 0) + outcomes.get("400", 0)
        print(f"burst: {attempts} attempts in {took:.1f}s: {outcomes}")
        assert outcomes.get("500", 0) == 0, _tail(log_path)
        assert served >= attempts * 3 // 5 * 0.9, outcomes  # 3 of 5 kinds get an answer
        # every stream ends (heartbeat 1 s finds the closed sockets) and every fd goes
        live: list[str] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            async with http.get(base + "/metrics") as r:
                text = await r.text()
            live = [
                ln for ln in text.splitlines()
                if ln.startswith("tokenrelay_relay_connections{")
            ]  # fmt: skip
            if all(ln.endswith(" 0.0") for ln in live) and _fds(proc.pid)[1] <= 1:
                break
            await asyncio.sleep(0.5)
        assert all(ln.endswith(" 0.0") for ln in live), live
        after = _fds(proc.pid)
        print(f"relay fds before {before}, after {after} (all, client sockets)")
        # no client socket is left (1: this test's keep-alive connection); the other
        # fds may grow by the Redis connections opened for concurrent watches, which
        # redis-py keeps pooled: at most one per admitted stream (max_connections)
        assert after[1] <= 1, (before, after)
        assert after[0] - after[1] <= before[0] - before[1] + max_conn, (before, after)
        # and a normal client works right after
        async with http.get(base + "/healthz") as r:
            assert r.status == 200
        async with http.get(
            base + f"/v1/sessions/{sid}/events", params={"token": t, "last_event_id": "0"}
        ) as r:
            assert r.status == 200
            client = SSEClient(r)
            gen = await Publisher(redis).open_generation(sid)
            off = await gen.token("after the burst")
            ev = await asyncio.wait_for(client.next_event(), STEP)
            assert ev is not None
            assert int(ev[0]) == off


@pytest.mark.timeout(120)
async def test_unfinished_request_heads_get_408_and_free_their_sockets(cluster, tmp_path):
    """Slowloris on the head: 500 connections each send part of a request head and
    stall. Each gets 408 with the reason at the head deadline and is closed (the relay's
    client sockets go back to 0); a normal request is served meanwhile; the relay counts
    them as rejected{reason="head_timeout"}."""
    n, deadline_s = 500, 1.0
    flags = ("--head-timeout-s", str(deadline_s))
    async with (
        relay_process(cluster, tmp_path, "edge-heads", *flags) as relay,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http,
    ):
        partial = [b"", b"GET /v1/sessio", b"GET /healthz HTTP/1.1\r\nHost: x\r\n"]
        conns = []
        for i in range(n):
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
            writer.write(partial[i % len(partial)])
            conns.append((reader, writer))
        started = time.monotonic()
        async with http.get(relay.base + "/healthz") as r:  # served while they stall
            assert r.status == 200
        async with asyncio.timeout(30):
            answers = await asyncio.gather(*(r.read() for r, _ in conns))
        took = time.monotonic() - started
        for _, w in conns:
            w.close()
        assert all(a.startswith(b"HTTP/1.1 408 Request Timeout\r\n") for a in answers)
        assert all(a.endswith(b"request head not received in time\n") for a in answers)
        assert took < deadline_s + 15
        async with asyncio.timeout(10):
            while _fds(relay.proc.pid)[1] > 1:  # 1: this test's keep-alive connection
                await asyncio.sleep(0.1)
        async with http.get(relay.base + "/metrics") as r:
            text = await r.text()
        line = next(ln for ln in text.splitlines() if 'reason="head_timeout"' in ln)
        assert float(line.rsplit(" ", 1)[1]) == n


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


async def test_malformed_resume_offsets_get_400_bad_offset(cluster, redis):
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
                assert (status, body["error"]) == (400, "bad_offset"), (raw[:20], path, body)
                assert body["reason"].startswith(name), body
        # the header wins over the query, even when the query is fine
        status, body = await get_json(
            relay.http,
            relay.url(sid),
            params={"token": t, "last_event_id": "3"},
            headers={"Last-Event-ID": "x"},
        )
        assert (status, body["error"]) == (400, "bad_offset")
        # a NUL byte in a header never reaches the app
        req = f"GET /v1/sessions/{sid}/events?token={t} HTTP/1.1\r\nHost: x\r\n"
        status, raw_body = await raw_http(
            env.relay_port, req.encode() + b"Last-Event-ID: 5\x00\r\n\r\n"
        )
        assert status == 400
        assert raw_body.startswith(b"Invalid header value char"), raw_body


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
