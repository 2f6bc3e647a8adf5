"""The Durable Streams front against a client holding one token (RELIABILITY.md, "Durable
Streams against one token"): forks of streams it may not read, a victim's delete that
a fork kept from removing anything, writes past Lua's unpack limit, a fork copied past
the stream's byte bound, a JSON array of a million elements, NaN, lone surrogates, deep
nesting, the largest Stream-TTL, and a store error whose text reached the client.

A relay in this process on the suite's cluster, tokens as an app mints them; each test
also writes and reads a well-behaved stream (the bystander) before and after its
attack, and checks that nothing was logged as an unhandled exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from relay.broker.port import MESSAGE_OVERHEAD, StreamStore
from relay.broker.rediscluster.streams import RedisStreams
from relay.durable import fork, store
from relay.durable.auth import token_subject
from relay.durable.core import MAX_WRITE_MESSAGES, format_offset
from relay.protocol.auth import Scope, issue_token
from tests.support.relay import SECRET, Relay, running

pytestmark = pytest.mark.integration

JSON = {"Content-Type": "application/json"}
OPEN = "open/"


def _token(path: str, scope: Scope = "write") -> str:
    return issue_token(SECRET, token_subject(path), 300, time.time(), scope=scope)


def _bearer(path: str, scope: Scope = "write") -> dict[str, str]:
    return {"Authorization": f"Bearer {_token(path, scope)}"}


def _private() -> str:
    return f"chat/{uuid.uuid4().hex[:12]}"


def _url(relay: Relay, path: str) -> str:
    return f"{relay.base}/v1/stream/{path}"


@contextlib.asynccontextmanager
async def _relay(
    cluster: ClusterInfo, caplog: pytest.LogCaptureFixture, **kw: Any
) -> AsyncIterator[Relay]:
    """A relay with the attack's flags, a bystander stream written and read before and
    after, and no unhandled exception logged."""
    caplog.set_level(logging.WARNING)
    async with running(cluster, durable_open_prefix="/" + OPEN, **kw) as relay:
        path = _private()
        url, auth = _url(relay, path), _bearer(path)
        async with relay.http.put(url, headers={**JSON, **auth}, data=b'[{"n":1}]') as r:
            assert r.status == 201, await r.text()
        yield relay
        async with relay.http.post(url, headers={**JSON, **auth}, data=b'[{"n":2}]') as r:
            assert r.status == 204, await r.text()
        async with relay.http.get(url, headers=auth) as r:
            assert await r.json() == [{"n": 1}, {"n": 2}]
        async with relay.http.get(f"{relay.base}/healthz") as r:
            assert r.status == 200
    crashes = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert not crashes, [r.getMessage() for r in crashes]


async def _count(streams: StreamStore, path: str) -> int | None:
    view = await store.read(streams, store.StreamRef.of(path), 0, count=0, touch=False)
    return None if view is None else view.next


async def test_a_fork_needs_a_token_that_reads_its_source(
    cluster: ClusterInfo, redis: RedisCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """The attacker's own write token forks nothing it may not read; the victim's forks
    set stays empty; a read token of the source (Stream-Forked-From-Token) forks it."""
    async with _relay(cluster, caplog) as relay:
        victim, mine = _private(), _private()
        async with relay.http.put(_url(relay, victim), headers={**JSON, **_bearer(victim)},
                                  data=b'[{"secret":true}]') as r:  # fmt: skip
            assert r.status == 201
        fork_from = {"Stream-Forked-From": f"/v1/stream/{victim}"}
        for extra in ({}, {"Stream-Forked-From-Token": _token(mine)},
                      {"Stream-Forked-From-Token": "garbage"}):  # fmt: skip
            h = {**JSON, **_bearer(mine), **fork_from, **extra}
            async with relay.http.put(_url(relay, mine), headers=h) as r:
                text = await r.text()
                assert r.status in (401, 403), (r.status, text)
                assert "source" in text
        async with relay.http.get(_url(relay, mine), headers=_bearer(mine, "watch")) as r:
            assert r.status == 404  # no fork was made
        assert await redis.scard(store.StreamRef.of(victim).forks) == 0
        h = {**JSON, **_bearer(mine), **fork_from,
             "Stream-Forked-From-Token": _token(victim, "watch")}  # fmt: skip
        async with relay.http.put(_url(relay, mine), headers=h) as r:
            assert r.status == 201, await r.text()
        async with relay.http.get(_url(relay, mine), headers=_bearer(mine, "watch")) as r:
            assert await r.json() == [{"secret": True}]


async def test_a_sources_delete_removes_its_data_and_the_fork_lives_on(
    cluster: ClusterInfo, redis: RedisCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """With a fork alive, the source's DELETE removes its log and producers (the
    protocol keeps only a tombstone: 410, its path blocked); the fork reads and appends
    on its own; once the fork goes, the path is free and a re-create works."""
    async with _relay(cluster, caplog) as relay:
        src, child = f"{OPEN}{uuid.uuid4().hex}", f"{OPEN}{uuid.uuid4().hex}"
        h = {**JSON, "Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": "0"}
        async with relay.http.put(_url(relay, src), headers=JSON) as r:
            assert r.status == 201
        async with relay.http.post(_url(relay, src), headers=h, data=b'[{"a":1},{"b":2}]') as r:
            assert r.status == 200
        h = {**JSON, "Stream-Forked-From": f"/v1/stream/{src}"}
        async with relay.http.put(_url(relay, child), headers=h) as r:
            assert r.status == 201
        ref = store.StreamRef.of(src)
        assert await redis.exists(ref.log, ref.prod) == 2
        async with relay.http.delete(_url(relay, src)) as r:
            assert r.status == 204
        assert await redis.exists(ref.log, ref.prod) == 0  # the data is gone
        async with relay.http.head(_url(relay, src)) as r:
            assert r.status == 410
        async with relay.http.post(_url(relay, child), headers=JSON, data=b'{"c":3}') as r:
            assert r.status == 204
        async with relay.http.get(_url(relay, child)) as r:
            assert await r.json() == [{"a": 1}, {"b": 2}, {"c": 3}]
        async with relay.http.delete(_url(relay, child)) as r:
            assert r.status == 204
        assert await redis.exists(*ref.keys) == 0
        async with relay.http.put(_url(relay, src), headers=JSON, data=b"[1]") as r:
            assert r.status == 201, await r.text()


async def test_a_fork_that_expired_no_longer_blocks_its_deleted_source(
    cluster: ClusterInfo, caplog: pytest.LogCaptureFixture
) -> None:
    """A fork's expiry released nothing: its deleted source's path answered 409 to a
    re-create for ever. Now the re-create releases the expired fork's reference."""
    async with _relay(cluster, caplog) as relay:
        src, child = f"{OPEN}{uuid.uuid4().hex}", f"{OPEN}{uuid.uuid4().hex}"
        async with relay.http.put(_url(relay, src), headers=JSON, data=b"[1]") as r:
            assert r.status == 201
        h = {**JSON, "Stream-Forked-From": f"/v1/stream/{src}", "Stream-TTL": "1"}
        async with relay.http.put(_url(relay, child), headers=h) as r:
            assert r.status == 201
        async with relay.http.delete(_url(relay, src)) as r:
            assert r.status == 204
        async with relay.http.put(_url(relay, src), headers=JSON) as r:
            assert r.status == 409  # the fork lives: the protocol's tombstone
        await asyncio.sleep(1.3)
        async with relay.http.put(_url(relay, src), headers=JSON, data=b"[2]") as r:
            assert r.status == 201, await r.text()
        async with relay.http.get(_url(relay, src)) as r:
            assert await r.json() == [2]


async def test_writes_past_luas_unpack_limit_are_whole(
    cluster: ClusterInfo, redis: RedisCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A create and an append of 9,000 JSON messages (Lua's unpack() failed past about
    8,000: 503, and the create left an empty stream) are written whole; one past the
    bound per write is 413 with the bound and writes nothing."""
    async with _relay(cluster, caplog) as relay:
        path = f"{OPEN}{uuid.uuid4().hex}"
        body = json.dumps(list(range(9000))).encode()
        async with relay.http.put(_url(relay, path), headers=JSON, data=body) as r:
            assert r.status == 201, await r.text()
        async with relay.http.post(_url(relay, path), headers=JSON, data=body) as r:
            assert r.status == 204, await r.text()
        too_many = json.dumps([0] * (MAX_WRITE_MESSAGES + 1)).encode()
        async with relay.http.post(_url(relay, path), headers=JSON, data=too_many) as r:
            assert r.status == 413
            assert str(MAX_WRITE_MESSAGES) in await r.text()
        streams = RedisStreams(redis)
        view = await store.read(streams, store.StreamRef.of(path), 0, count=20_000, touch=False)
        assert view is not None
        assert view.next == 18_000
        assert [int(m) for m in view.messages] == list(range(9000)) * 2


async def test_a_large_fork_is_copied_in_bounded_steps(
    cluster: ClusterInfo, redis: RedisCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A fork of a source at the documented bound (100,000 messages) is made, each of its
    writes at most a page; nothing of it is visible before it is whole; one more message
    and the fork is refused (413)."""
    async with _relay(cluster, caplog) as relay:
        src, child = f"{OPEN}{uuid.uuid4().hex}", f"{OPEN}{uuid.uuid4().hex}"
        async with relay.http.put(_url(relay, src), headers=JSON) as r:
            assert r.status == 201
        batch = json.dumps([1] * MAX_WRITE_MESSAGES).encode()
        for _ in range(fork.MAX_FORK_MESSAGES // MAX_WRITE_MESSAGES):
            async with relay.http.post(_url(relay, src), headers=JSON, data=batch) as r:
                assert r.status == 204, await r.text()
        assert relay.server.hub is not None
        streams = relay.server.hub.broker.streams  # type: ignore[attr-defined]
        sizes: list[tuple[str, int, int | None]] = []
        write = streams.stream_write

        async def spy(ref: Any, w: Any, messages: Any) -> Any:
            sizes.append((w.op, len(messages), await _count(streams, child)))
            return await write(ref, w, messages)

        streams.stream_write = spy
        try:
            h = {**JSON, "Stream-Forked-From": f"/v1/stream/{src}"}
            async with relay.http.put(_url(relay, child), headers=h, data=b'["own"]') as r:
                assert r.status == 201, await r.text()
        finally:
            del streams.stream_write
        assert max(n for _, n, _ in sizes) <= fork.PAGE_MESSAGES
        assert [op for op, _, _ in sizes] == ["build"] * 100 + ["put"]
        assert all(seen is None for _, _, seen in sizes)  # nobody saw a partial fork
        view = await store.read(
            RedisStreams(redis), store.StreamRef.of(child), 99_999, count=10, touch=False
        )
        assert view is not None
        assert (view.next, view.messages) == (100_001, [b"1", b'"own"'])
        async with relay.http.post(_url(relay, src), headers=JSON, data=b"[2]") as r:
            assert r.status == 204
        other = f"{OPEN}{uuid.uuid4().hex}"
        async with relay.http.put(_url(relay, other), headers=h) as r:
            assert r.status == 413
            assert "100000" in await r.text()


async def test_a_fork_is_held_to_the_stream_byte_bound_page_by_page(
    cluster: ClusterInfo, caplog: pytest.LogCaptureFixture
) -> None:
    """A fork copied in pages counts against ``--durable-max-stream-bytes`` as it is copied
    (each page and the commit, in the write's own Lua call): a source past the bound
    (written while it was higher) is not forked, the page that passes it is 413 and
    nothing of the fork is seen; nor is a fork whose own messages pass it at its commit;
    a fork under the bound is made."""
    src = f"{OPEN}{uuid.uuid4().hex}"
    unbounded = {"durable_token_bytes": 0, "durable_address_bytes": 0}
    async with running(cluster, durable_open_prefix="/" + OPEN, durable_max_stream_bytes=0,
                       **unbounded) as big:  # fmt: skip
        async with big.http.put(_url(big, src), headers=JSON) as r:
            assert r.status == 201
        page = json.dumps(["x" * 1000] * fork.PAGE_MESSAGES).encode()  # 1,002 bytes each
        for _ in range(3):
            async with big.http.post(_url(big, src), headers=JSON, data=page) as r:
                assert r.status == 204, await r.text()
    per_page = fork.PAGE_MESSAGES * (1002 + MESSAGE_OVERHEAD)
    bound = 2 << 20  # two pages fit (2,036,000 bytes), not three
    assert 2 * per_page < bound < 3 * per_page
    async with _relay(cluster, caplog, durable_max_stream_bytes=bound, **unbounded) as relay:
        assert relay.server.hub is not None
        streams = relay.server.hub.broker.streams  # type: ignore[attr-defined]
        ops: list[tuple[str, int]] = []
        write = streams.stream_write

        async def spy(ref: Any, w: Any, messages: Any) -> Any:
            r = await write(ref, w, messages)
            ops.append((w.op, r.code))
            return r

        streams.stream_write = spy
        try:
            h = {**JSON, "Stream-Forked-From": f"/v1/stream/{src}"}
            whole = f"{OPEN}{uuid.uuid4().hex}"
            async with relay.http.put(_url(relay, whole), headers=h) as r:
                assert r.status == 413
                assert f"the fork would hold more than the {bound} bytes" in await r.text()
            assert ops == [("build", 202), ("build", 202), ("build", 413)]
            assert await _count(streams, whole) is None
            ops.clear()
            two = {**h, "Stream-Fork-Offset": format_offset(2 * fork.PAGE_MESSAGES)}
            big_own = json.dumps(["y" * 100_000]).encode()  # 2 pages + this: past the bound
            tail = f"{OPEN}{uuid.uuid4().hex}"
            async with relay.http.put(_url(relay, tail), headers=two, data=big_own) as r:
                assert r.status == 413, await r.text()
            assert ops == [("build", 202), ("build", 202), ("put", 413)]
            assert await _count(streams, tail) is None
            ok = f"{OPEN}{uuid.uuid4().hex}"
            async with relay.http.put(_url(relay, ok), headers=two, data=b'["own"]') as r:
                assert r.status == 201, await r.text()
        finally:
            del streams.stream_write
        assert await _count(streams, ok) == 2 * fork.PAGE_MESSAGES + 1


async def test_a_million_element_array_is_refused_without_holding_the_relay(
    cluster: ClusterInfo, caplog: pytest.LogCaptureFixture
) -> None:
    """2 MB of ``0,``: 413 naming the bound, nothing written (it froze the relay ~15 s
    re-encoding a million messages). The loop's stall is bench/hostile/durable.py's."""
    async with _relay(cluster, caplog) as relay:
        path = f"{OPEN}{uuid.uuid4().hex}"
        async with relay.http.put(_url(relay, path), headers=JSON) as r:
            assert r.status == 201
        body = b"[" + b"0," * 999_999 + b"0]"
        async with relay.http.post(_url(relay, path), headers=JSON, data=body) as r:
            assert r.status == 413
            assert f"at most {MAX_WRITE_MESSAGES}" in await r.text()
        async with relay.http.get(_url(relay, path)) as r:
            assert await r.json() == []


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "JSON"),
        (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "JSON"),
        (b'["\\ud800"]', "surrogate"),
        (b'[{"k":"x\\udfff"}]', "surrogate"),
        (b"[NaN]", "NaN"),
        (b"[1,Infinity]", "Infinity"),
        (b'{"x":-Infinity}', "Infinity"),
        (b"[1e400]", "Infinity"),
    ],
)
async def test_json_that_json_parse_would_not_read_is_refused(
    cluster: ClusterInfo, caplog: pytest.LogCaptureFixture, body: bytes, reason: str
) -> None:
    """400 with a reason, nothing written, on a create and an append."""
    async with _relay(cluster, caplog) as relay:
        path = f"{OPEN}{uuid.uuid4().hex}"
        async with relay.http.put(_url(relay, path), headers=JSON, data=body) as r:
            assert r.status == 400
            assert reason in await r.text()
        async with relay.http.put(_url(relay, path), headers=JSON, data=b"[1]") as r:
            assert r.status == 201  # the refused create left nothing
        async with relay.http.post(_url(relay, path), headers=JSON, data=body) as r:
            assert r.status == 400
            assert reason in await r.text()
        async with relay.http.get(_url(relay, path)) as r:
            assert await r.json() == [1]


async def test_the_largest_stream_ttl_makes_a_working_stream(
    cluster: ClusterInfo, caplog: pytest.LogCaptureFixture
) -> None:
    """``Stream-TTL: 2^53-1`` (the largest accepted) answered 503 and left a stream that
    failed every read and write (the TTL reached Redis as a float in exponent form):
    now the stream is made and works; one past it is 400."""
    async with _relay(cluster, caplog) as relay:
        path = f"{OPEN}{uuid.uuid4().hex}"
        top = str((1 << 53) - 1)
        async with relay.http.put(_url(relay, path), headers={**JSON, "Stream-TTL": top}) as r:
            assert r.status == 201, await r.text()
        async with relay.http.post(_url(relay, path), headers=JSON, data=b"[1]") as r:
            assert r.status == 204, await r.text()
        async with relay.http.get(_url(relay, path)) as r:
            assert await r.json() == [1]
        async with relay.http.head(_url(relay, path)) as r:
            assert r.headers["Stream-TTL"] == top
        other = f"{OPEN}{uuid.uuid4().hex}"
        h = {**JSON, "Stream-TTL": str(1 << 53)}
        async with relay.http.put(_url(relay, other), headers=h) as r:
            assert r.status == 400
        async with relay.http.head(_url(relay, other)) as r:
            assert r.status == 404


async def test_a_store_error_reaches_the_log_not_the_client(
    cluster: ClusterInfo, redis: RedisCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream whose meta key another writer made a string (WRONGTYPE in the script):
    the answer says what happened in a sentence, without Redis's text, the script's SHA
    or its line; the log has them."""
    async with _relay(cluster, caplog) as relay:
        path = f"{OPEN}{uuid.uuid4().hex}"
        await redis.set(store.StreamRef.of(path).meta, "not a hash")
        for method, data in (("PUT", b"[1]"), ("POST", b"[1]"), ("GET", b""), ("DELETE", b"")):
            h = JSON if data else {}
            async with relay.http.request(method, _url(relay, path), headers=h, data=data) as r:
                text = await r.text()
                assert r.status == 500, (method, r.status, text)
                assert "logged" in text
                for leak in ("WRONGTYPE", "script", "user_script", "Redis is unavailable"):
                    assert leak not in text, (method, text)
                assert re.search(r"[0-9a-f]{40}", text) is None, text
        logged = [r.getMessage() for r in caplog.records if "durable" in r.getMessage()]
        assert any("WRONGTYPE" in m for m in logged), logged
        await redis.delete(store.StreamRef.of(path).meta)
