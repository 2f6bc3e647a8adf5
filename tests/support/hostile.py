"""The harness of the hostile-input tests (tests/test_hostile_*.py): a relay app and a
worker app on the suite's cluster (:func:`stack`), a well-behaved session alongside the
hostile input (:class:`Bystander`), a log handler that fails the test on any crash
(:func:`no_crash`), and raw HTTP helpers.

Every hostile test runs a relay app (``relay.edge.http.server.make_app``, 127.0.0.1, port 0)
and a worker app (:class:`tests.support.worker.Harness`: mock engines in-process) on
the session's real Redis Cluster, throws one kind of hostile input at them and checks
the status / close code AND the documented ``error`` / reason (docs/PROTOCOL.md, the
hostile-input table of RELIABILITY.md), that the bystander receives every frame of its
turns, and that nothing was logged as an unhandled exception.

Order of use::

    async with stack(cluster, redis, heartbeat_s=1) as env, bystander(env):
        status, body = await raw_http(env.relay_port, b"GET ... HTTP/1.1\r\n\r\n")
    # on the way out: the bystander got every frame, both apps answer /healthz,
    # nothing crashed
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError
from yarl import URL

from devstack.cluster.launcher import ClusterInfo
from relay.broker.rediscluster.publisher import read_backlog
from relay.protocol.auth import issue_token
from relay.protocol.frame import decode
from tests.support.relay import STEP, Relay, running
from tests.support.sse import SSEClient
from tests.support.worker import SECRET, Harness

__all__ = ["Bystander", "Env", "bystander", "get_json", "no_crash", "raw_http", "stack", "tok"]

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
async def stack(
    cluster: ClusterInfo, redis: Any, *, worker: dict[str, Any] | None = None,
    **relay_overrides: Any,
) -> AsyncIterator[Env]:  # fmt: skip
    """A relay (``relay_overrides``: :class:`RelayConfig` fields) and a worker
    (``worker``: :class:`WorkerConfig` fields), each served through its HTTP guard."""
    harness = Harness(redis)
    try:
        with no_crash():
            await harness.start_engines(2, decode_tok_per_s=300.0)
            await harness.start_worker(guarded=True, **(worker or {}))
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
