"""Hostile clients against access control and abuse limits, on a real relay, a real
worker and the session's real Redis Cluster (the style of tests/test_hostile_*.py: each
test runs a well-behaved bystander session that must receive every frame of its two
turns, in order, and both apps must stay healthy with nothing logged as a crash).

Classes: scoped tokens (a watch token posting a turn or minting a write token), minted
lifetimes, open streams ending at token expiry (SSE close comment, WebSocket 4401),
HS/RS algorithm confusion against a relay holding an RSA public key, the 17th stream on
one token, streams per client address behind a trusted proxy, a session-creation flood
from one address while another address is served, turns per session per minute, a turn
without ``max_tokens`` against an engine that never stops, and unsafe configurations
refused at start (exit 2, one line).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from devstack.cluster.launcher import ClusterInfo
from relay.broker.rediscluster.publisher import read_backlog
from relay.edge.conn.ws import WS_CLOSE
from relay.protocol.codes import CloseCode
from relay.protocol.frame import decode
from tests.support.cli import clean_env, devstack, run_cli, tokenrelay
from tests.support.hostile import Env, bystander, no_crash
from tests.support.relay import STEP, running
from tests.support.sse import SSEClient
from tests.support.worker import SECRET, Harness
from worker.chat.store import SessionStore
from worker.engines.client import EngineClient

pytestmark = pytest.mark.integration


@asynccontextmanager
async def access_stack(
    cluster: ClusterInfo,
    redis: Any,
    *,
    worker: dict[str, Any] | None = None,
    relay: dict[str, Any] | None = None,
) -> AsyncIterator[Env]:
    """Like tests.support.hostile.stack, with worker and relay settings of the test's own."""
    harness = Harness(redis)
    try:
        with no_crash():
            await harness.start_engines(2, decode_tok_per_s=300.0)
            await harness.start_worker(**(worker or {}))
            async with running(cluster, **(relay or {})) as r:
                env = Env(r, harness, redis)
                yield env
                await env.healthy()
    finally:
        await harness.stop()


async def mint(
    env: Env, sid: str, token: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    http = env.worker.http
    assert http is not None
    hdrs = {"Authorization": f"Bearer {token}", **(headers or {})}
    async with http.post(
        env.worker.url(f"/v1/sessions/{sid}/tokens"), json=body, headers=hdrs
    ) as r:
        return r.status, await r.json(content_type=None)


async def open_sse(
    env: Env, sid: str, token: str, headers: dict[str, str] | None = None
) -> aiohttp.ClientResponse:
    hdrs = {"Authorization": f"Bearer {token}", **(headers or {})}
    return await env.relay.http.get(env.relay.url(sid), headers=hdrs)


async def refused(resp: aiohttp.ClientResponse) -> tuple[int, str, str | None]:
    body = await resp.json(content_type=None)
    resp.close()
    assert body["reason"]
    return resp.status, body["error"], resp.headers.get("Retry-After")


# -- scopes and minted tokens -----------------------------------------------------------


async def test_watch_tokens_watch_but_never_write_or_mint_write_tokens(cluster, redis):
    worker = {"max_token_ttl_s": 600, "session_ttl_s": 900}
    async with access_stack(cluster, redis, worker=worker) as env, bystander(env) as b:
        sid, write = await env.worker.session()
        status, body = await mint(env, sid, write, {"scope": "watch", "ttl_s": 120})
        assert status == 201, body
        assert body["scope"] == "watch"
        assert body["session"] == sid
        assert abs(body["expires_at"] - (time.time() + 120)) < 5
        watch = body["token"]
        assert jwt.get_unverified_header(watch)["kid"] == "k1"
        resp = await open_sse(env, sid, watch)  # a watch token watches
        assert resp.status == 200
        resp.close()
        # ... and never writes: no turn, no token of either scope
        status, got, _ = await env.worker.post_turn(sid, watch, {"message": "hi"})
        assert (status, got["error"]) == (403, "token_wrong_scope")
        for scope in ("write", "watch"):
            status, got = await mint(env, sid, watch, {"scope": scope})
            assert (status, got["error"]) == (403, "token_wrong_scope")
        # lifetimes are capped by --max-token-ttl-s (600) below the session's (900)
        status, body = await mint(env, sid, write, {"scope": "write", "ttl_s": 10**9})
        assert status == 201
        assert body["expires_at"] <= time.time() + 601
        fresh = body["token"]
        status, got, _ = await env.worker.post_turn(sid, fresh, {"message": "hi", "max_tokens": 2})
        assert status == 202, got
        # a write token of session A mints nothing for session B (the bystander)
        status, got = await mint(env, b.sid, write, {"scope": "watch"})
        assert (status, got["error"]) == (403, "token_wrong_session")
        status, got = await mint(env, sid, "", {"scope": "watch"}, {"Authorization": ""})
        assert (status, got["error"]) == (401, "token_missing")
        for bad in ({"scope": "admin"}, {"ttl_s": 0}, {"ttl_s": "60"}, {"ttl_s": True}, [1]):
            status, got = await mint(env, sid, write, bad)
            assert (status, got["error"]) == (400, "invalid_token_request"), bad


async def test_minted_lifetime_never_exceeds_the_sessions(cluster, redis):
    worker = {"max_token_ttl_s": 86_400, "session_ttl_s": 300}
    async with access_stack(cluster, redis, worker=worker) as env, bystander(env):
        sid, write = await env.worker.session()
        status, body = await mint(env, sid, write, {"scope": "watch", "ttl_s": 3600})
        assert status == 201
        assert body["expires_at"] <= time.time() + 301
        claims = jwt.decode(body["token"], SECRET, algorithms=["HS256"])
        assert claims["exp"] - claims["iat"] <= 300


# -- expiry while a stream is open ------------------------------------------------------


async def test_open_streams_end_when_their_token_expires(cluster, redis):
    async with access_stack(cluster, redis) as env, bystander(env):
        sid, write = await env.worker.session()
        status, body = await mint(env, sid, write, {"scope": "watch", "ttl_s": 2})
        assert status == 201
        short = body["token"]
        resp = await open_sse(env, sid, short)
        assert resp.status == 200
        client = SSEClient(resp)
        ws = await env.relay.http.ws_connect(
            env.relay.url(sid, "ws"), headers={"Authorization": f"Bearer {short}"}
        )
        async with asyncio.timeout(STEP):
            await client.until_end()
            while (await ws.receive()).type is not aiohttp.WSMsgType.CLOSE:
                pass
        assert any(c.startswith("close token_expired ") for c in client.comments), client.comments
        assert ws.close_code == WS_CLOSE[CloseCode.TOKEN_EXPIRED][0] == 4401
        resp.close()
        await ws.close()
        again = await open_sse(env, sid, short)  # the same token cannot come back
        assert await refused(again) == (403, "token_expired", None)
        closes = env.relay.server.metrics.closes
        assert closes.labels("sse", "token_expired")._value.get() == 1
        assert closes.labels("ws", "token_expired")._value.get() == 1


# -- algorithm confusion against a relay with a public key ----------------------------


async def test_hs256_signed_with_the_relays_rsa_public_key_is_refused(cluster, redis, tmp_path):
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = private.public_key()
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(public))
    keys = tmp_path / "relay-keys.json"
    keys.write_text(json.dumps({"keys": [{**jwk, "kid": "r1"}]}))
    relay = {"keys_file": str(keys)}  # plus the shared HS256 secret (the bystander's tokens)
    async with access_stack(cluster, redis, relay=relay) as env, bystander(env):
        sid, _ = await env.worker.session()
        now = int(time.time())
        claims = {"sub": sid, "scope": "write", "iat": now, "exp": now + 300}
        pem = public.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        for key_bytes in (pem, json.dumps(jwk).encode()):
            head = jwt.utils.base64url_encode(
                json.dumps({"alg": "HS256", "typ": "JWT", "kid": "r1"}).encode()
            )
            body = jwt.utils.base64url_encode(json.dumps(claims).encode())
            signing_input = head + b"." + body
            sig = jwt.utils.base64url_encode(
                hmac.new(key_bytes, signing_input, hashlib.sha256).digest()
            )
            forged = (signing_input + b"." + sig).decode()
            assert await refused(await open_sse(env, sid, forged)) == (
                403,
                "token_invalid",
                None,
            )
        genuine = jwt.encode(claims, private, algorithm="RS256", headers={"kid": "r1"})
        resp = await open_sse(env, sid, genuine)
        assert resp.status == 200
        resp.close()


async def test_an_es256_worker_and_relays_holding_only_the_public_key(cluster, redis, tmp_path):
    """The asymmetric option end to end: the worker signs with a private P-256 key, the
    relay verifies with the public half (and could not mint); an HS256 token under the
    shared secret's kid is still accepted where the relay holds that secret."""
    private = ec.generate_private_key(ec.SECP256R1())
    for name, key in (("worker", private), ("relay", private.public_key())):
        jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(key))
        (tmp_path / f"{name}.json").write_text(json.dumps({"keys": [{**jwk, "kid": "e1"}]}))
    worker = {"secret": None, "keys_file": str(tmp_path / "worker.json"), "kid": "e1"}
    relay = {"keys_file": str(tmp_path / "relay.json")}
    async with access_stack(cluster, redis, worker=worker, relay=relay) as env, bystander(env):
        assert env.relay.server.keys is not None
        assert env.relay.server.keys.has_private_keys() == []
        sid, token = await env.worker.session()
        assert jwt.get_unverified_header(token) == {"alg": "ES256", "typ": "JWT", "kid": "e1"}
        resp = await open_sse(env, sid, token)
        assert resp.status == 200
        resp.close()
        # an ES256 token signed by another key under the same kid
        other = ec.generate_private_key(ec.SECP256R1())
        now = int(time.time())
        claims = {"sub": sid, "scope": "write", "iat": now, "exp": now + 300}
        forged = jwt.encode(claims, other, algorithm="ES256", headers={"kid": "e1"})
        assert await refused(await open_sse(env, sid, forged)) == (403, "token_invalid", None)
        status, body, _ = await env.worker.post_turn(sid, forged, {"message": "hi"})
        assert (status, body["error"]) == (403, "token_invalid")


# -- stream limits ------------------------------------------------------------------------


async def test_the_17th_stream_on_one_token_gets_429(cluster, redis):
    async with access_stack(cluster, redis) as env, bystander(env):
        sid, token = await env.worker.session()
        held = [await open_sse(env, sid, token) for _ in range(16)]
        assert [r.status for r in held] == [200] * 16
        status, error, retry = await refused(await open_sse(env, sid, token))
        assert (status, error) == (429, "too_many_streams")
        assert retry is not None
        assert int(retry) >= 1
        with pytest.raises(aiohttp.WSServerHandshakeError) as exc:
            await env.relay.http.ws_connect(
                env.relay.url(sid, "ws"), headers={"Authorization": f"Bearer {token}"}
            )
        assert exc.value.status == 429
        # another token of the same session has its own share
        _, body = await mint(env, sid, token, {"scope": "watch"})
        other = await open_sse(env, sid, body["token"])
        assert other.status == 200
        other.close()
        # closing one stream frees its slot
        held.pop().close()
        async with asyncio.timeout(STEP):
            while sum(env.relay.server.guard.by_token.values()) > 16:
                await asyncio.sleep(0.02)
        again = await open_sse(env, sid, token)
        assert again.status == 200
        for r in [*held, again]:
            r.close()
        assert env.relay.server.metrics.rejected.labels("too_many_streams")._value.get() == 2


async def test_streams_per_address_count_the_client_behind_a_trusted_proxy(cluster, redis):
    relay = {"trusted_proxies": "127.0.0.1", "max_streams_per_address": 3}
    async with access_stack(cluster, redis, relay=relay) as env, bystander(env):
        sid, write = await env.worker.session()
        tokens = [(await mint(env, sid, write, {"scope": "watch"}))[1]["token"] for _ in range(5)]
        one = {"X-Forwarded-For": "203.0.113.7"}
        held = [await open_sse(env, sid, t, one) for t in tokens[:3]]  # distinct tokens
        assert [r.status for r in held] == [200] * 3
        status, error, retry = await refused(await open_sse(env, sid, tokens[3], one))
        assert (status, error, retry) == (429, "too_many_streams", "5")
        # the client cannot pick its address: what it claims is left of the proxy's entry
        spoof = {"X-Forwarded-For": "198.51.100.1, 203.0.113.7"}
        assert (await refused(await open_sse(env, sid, tokens[3], spoof)))[0] == 429
        two = await open_sse(env, sid, tokens[4], {"X-Forwarded-For": "203.0.113.8"})
        assert two.status == 200  # another address is served
        for r in [*held, two]:
            r.close()


# -- session creation and turn rates ------------------------------------------------------


async def test_a_session_creation_flood_from_one_address_gets_429_not_the_others(cluster, redis):
    worker = {"trusted_proxies": "127.0.0.1", "session_rate_per_s": 0.2, "session_burst": 5}
    async with access_stack(cluster, redis, worker=worker) as env, bystander(env):
        http = env.worker.http
        assert http is not None

        async def create(addr: str) -> tuple[int, str | None, dict[str, Any]]:
            async with http.post(
                env.worker.url("/v1/sessions"), headers={"X-Forwarded-For": addr}
            ) as r:
                return r.status, r.headers.get("Retry-After"), await r.json()

        flood = [await create("192.0.2.10") for _ in range(20)]
        assert [s for s, _, _ in flood] == [201] * 5 + [429] * 15
        _, retry, body = flood[5]
        assert body["error"] == "session_rate"
        assert body["reason"]
        assert retry is not None
        assert 1 <= int(retry) <= 5  # one token every 5 s
        status, _, body = await create("192.0.2.11")
        assert status == 201, body
        assert env.worker.state.metrics.rejected.labels(status="429")._value.get() == 15


async def test_turns_per_session_per_minute_get_429_with_retry_after(cluster, redis):
    async with access_stack(cluster, redis, worker={"turns_per_minute": 3}) as env, bystander(env):
        if time.time() % 60 > 50:  # all four requests in one clock minute
            await asyncio.sleep(61 - time.time() % 60)
        sid, token = await env.worker.session()
        got = [
            await env.worker.post_turn(sid, token, {"message": f"t{i}", "max_tokens": 2})
            for i in range(4)
        ]
        assert all(s in (202, 409) for s, _, _ in got[:3]), got
        status, body, headers = got[3]
        assert (status, body["error"]) == (429, "turn_rate"), body
        assert 1 <= int(headers["Retry-After"]) <= 60
        # another session of the same client keeps its own budget
        other, other_token = await env.worker.session()
        status, body, _ = await env.worker.post_turn(
            other, other_token, {"message": "x", "max_tokens": 2}
        )
        assert status == 202, body


# -- max_tokens: an engine that never stops ------------------------------------------


class EndlessEngine:
    """An OpenAI-compatible engine that ignores max_tokens and never finishes: it
    streams 100-byte chunks until the client hangs up. Records every request body and
    how many of its streams the client closed."""

    CHUNK = ("lorem ipsum dolor sit amet " * 4)[:100]

    def __init__(self, chunk: str = CHUNK) -> None:
        self.chunk = chunk
        self.bodies: list[dict[str, Any]] = []
        self.hung_up = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"id": "endless", "choices": [{"index": 0, "delta": {"content": self.chunk}}]}
        data = b"data: " + json.dumps(chunk).encode() + b"\n\n"
        try:
            while True:
                await resp.write(data)
                await asyncio.sleep(0.002)
        except (ConnectionError, asyncio.CancelledError):
            self.hung_up += 1
            raise

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def _turn_frames(redis: Any, sid: str, turn: int) -> list[Any]:
    async with asyncio.timeout(STEP * 2):
        while True:
            raw, _, _ = await read_backlog(redis, sid, 0, 100_000)
            frames = [f for f in map(decode, raw) if f.turn == turn]
            if any(f.kind in ("done", "error") for f in frames):
                return frames
            await asyncio.sleep(0.05)


async def test_a_turn_without_max_tokens_ends_at_the_bound_of_an_endless_engine(cluster, redis):
    engine = EndlessEngine()
    await engine.start()
    try:
        worker = {"default_max_tokens": 10, "max_reply_bytes": 2048, "max_tokens_limit": 4096,
                  "engine_urls": (f"endless={engine.url}",), "engine_cap": 8}  # fmt: skip
        async with access_stack(cluster, redis, worker=worker) as env, bystander(env):
            sid, token = await env.worker.session()
            status, body, _ = await env.worker.post_turn(sid, token, {"message": "go on"})
            assert status == 202, body
            frames = await _turn_frames(redis, sid, body["turn"])
            text = "".join(f.text for f in frames if f.kind == "token")
            done = frames[-1]
            assert done.kind == "done"
            assert (done.meta or {}).get("finish_reason") == "length"
            assert text == EndlessEngine.CHUNK * 10  # 10 chunks: the default bound
            assert engine.bodies[-1]["max_tokens"] == 10  # and the engine was told so
            # a large max_tokens: the reply is cut at --max-reply-bytes instead
            status, body, _ = await env.worker.post_turn(
                sid, token, {"message": "more", "max_tokens": 4000}
            )
            assert status == 202, body
            frames = await _turn_frames(redis, sid, body["turn"])
            text = "".join(f.text for f in frames if f.kind == "token")
            assert len(text.encode()) == 2048
            assert (frames[-1].meta or {}).get("finish_reason") == "length"
            assert engine.bodies[-1]["max_tokens"] == 4000
            history = await SessionStore(redis).load(sid)
            replies = [m["content"] for m in history.messages if m["role"] == "assistant"]
            assert [len(r.encode()) for r in replies] == [1000, 2048]
            async with asyncio.timeout(STEP):  # the engine saw every cut stream hang up
                while engine.hung_up < len(engine.bodies):
                    await asyncio.sleep(0.05)
    finally:
        await engine.stop()


async def test_the_engine_client_cuts_an_endless_reply_on_a_character_boundary():
    """Bystander-free (no relay, no Redis): the engine client alone, against an engine
    sending 3-byte characters that never stops; the cut keeps whole characters."""
    engine = EndlessEngine(chunk="€" * 7)  # 21 bytes a chunk
    await engine.start()
    try:
        async with aiohttp.ClientSession() as http:
            client = EngineClient(http, max_reply_bytes=1000)
            deltas = [d async for d in client.stream_chat(engine.url, "m", [], 10_000)]
        text = "".join(d.text for d in deltas)
        assert deltas[-1].finish_reason == "length"
        assert text == "€" * 333  # 999 bytes: the 334th character would pass 1000
        async with aiohttp.ClientSession() as http:
            client = EngineClient(http, max_reply_bytes=10**6)
            deltas = [d async for d in client.stream_chat(engine.url, "m", [], 5)]
        assert "".join(d.text for d in deltas) == "€" * 35  # 5 chunks
        assert deltas[-1].finish_reason == "length"
        async with asyncio.timeout(STEP):
            while engine.hung_up < 2:
                await asyncio.sleep(0.05)
    finally:
        await engine.stop()


# -- unsafe configuration refused at start ------------------------------------------------


WEAK = "short"
EXAMPLE = "change-me-in-production-0123456789abcdef"
STRONG = "hostile-access-strong-secret-6d2f8b4a1c9e7035"


async def _exit_of(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    command = devstack if argv[0] == "demo" else tokenrelay  # the demo runs from a checkout
    ran = await run_cli(command(*argv), env=clean_env(**env), timeout_s=30)
    assert not ran.out.strip(), ran.out
    return ran.code, ran.err


async def test_unsafe_configurations_are_refused_at_start_with_exit_2(cluster, redis):
    relay = ["relay", "--port", "0", "--redis", cluster.url]
    worker = ["worker", "--port", "0", "--redis", cluster.url, "--engine", "http://127.0.0.1:9"]
    cases: list[tuple[list[str], dict[str, str], str]] = [
        (relay, {"TOKENRELAY_SECRET": WEAK}, "at least 32"),
        (relay, {"TOKENRELAY_SECRET": EXAMPLE}, "example"),
        (relay, {"TOKENRELAY_SECRET": "z" * 48}, "distinct"),
        (relay, {}, "no token secret"),
        (relay, {"TOKENRELAY_SECRET": STRONG, "TOKENRELAY_INSECURE_NO_AUTH": "1"}, "choose one"),
        ([*relay, "--insecure-no-auth"], {"TOKENRELAY_SECRET": STRONG}, "choose one"),
        (worker, {"TOKENRELAY_SECRET": WEAK}, "at least 32"),
        (worker, {"TOKENRELAY_SECRET": EXAMPLE}, "example"),
        (worker, {}, "TOKENRELAY_SECRET"),
        ([*worker, "--insecure-no-auth"], {"TOKENRELAY_SECRET": STRONG}, "choose one"),
        (worker, {"TOKENRELAY_SECRET": STRONG, "TOKENRELAY_INSECURE_NO_AUTH": "yes"}, "choose one"),
        (["demo", "--port", "0"], {"TOKENRELAY_SECRET": WEAK}, "at least 32"),
        (["demo", "--insecure-no-auth"], {"TOKENRELAY_SECRET": STRONG}, "choose one"),
    ]
    async with access_stack(cluster, redis) as env, bystander(env):
        assert env.relay.server.keys is not None
        for argv, extra, why in cases:
            code, err = await _exit_of(argv, extra)
            assert code == 2, (argv[0], extra, err)
            lines = err.strip().splitlines()
            assert len(lines) == 1, err
            assert lines[0].startswith("error: "), err
            assert why in lines[0], (why, err)
            assert "Traceback" not in err
            for secret in (WEAK, EXAMPLE, STRONG):  # the message never echoes a secret
                assert secret not in err


def test_the_demo_target_passes_a_random_secret_by_environment() -> None:
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    recipe = makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert "TOKENRELAY_SECRET=" in recipe
    assert "secrets.token_urlsafe(32)" in recipe
    assert "--secret" not in recipe
    assert "demo-secret" not in recipe
