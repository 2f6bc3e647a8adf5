"""Hostile tokens that are genuine in the cryptographic sense but not in the protocol's:
the high-S twin of an ES256 signature, a header with a critical extension, a lifetime
of 10^10 s, and two spellings of one token used to double its stream share.

The style of tests/hostile/test_hostile_access.py: a real relay and a real worker on the
suite's cluster, a well-behaved bystander session that gets every frame of its two
turns, both apps healthy afterwards, nothing logged as a crash.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from tests.hostile.test_hostile_access import access_stack, open_sse
from tests.hostile.test_hostile_access import refused as _refused
from tests.support.hostile import bystander
from tests.support.worker import SECRET

pytestmark = pytest.mark.integration


async def refused(resp: aiohttp.ClientResponse) -> tuple[int, str, str | None]:
    """The refusal's status, ``error`` and ``Retry-After``; a stream that was served
    instead is closed at once (its status says so) rather than read."""
    if resp.status == 200:
        resp.close()
        return 200, "", None
    return await _refused(resp)


P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _twin(token: str) -> str:
    """The ES256 token with ``s`` replaced by ``n - s``: it verifies under plain ECDSA."""
    head, body, sig = token.split(".")
    raw = base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4))
    s = int.from_bytes(raw[32:], "big")
    return f"{head}.{body}.{_b64(raw[:32] + (P256_ORDER - s).to_bytes(32, 'big'))}"


async def test_the_high_s_twin_of_an_es256_token_is_refused(cluster, redis, tmp_path: Path):
    private = ec.generate_private_key(ec.SECP256R1())
    for name, key in (("worker", private), ("relay", private.public_key())):
        jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(key))
        (tmp_path / f"{name}.json").write_text(json.dumps({"keys": [{**jwk, "kid": "e1"}]}))
    worker = {"secret": None, "keys_file": str(tmp_path / "worker.json"), "kid": "e1"}
    relay = {"keys_file": str(tmp_path / "relay.json")}
    async with access_stack(cluster, redis, worker=worker, relay=relay) as env, bystander(env):
        sid, token = await env.worker.session()
        twin = _twin(token)
        pub = private.public_key()
        head, body, _ = twin.split(".")
        raw = base64.urlsafe_b64decode(twin.split(".")[2] + "==")
        der = jwt.algorithms.ECAlgorithm(jwt.algorithms.ECAlgorithm.SHA256)
        assert der.verify(f"{head}.{body}".encode(), pub, raw)  # ECDSA takes it
        ok = await open_sse(env, sid, token)
        assert ok.status == 200
        ok.close()
        assert await refused(await open_sse(env, sid, twin)) == (403, "token_invalid", None)
        status, got, _ = await env.worker.post_turn(sid, twin, {"message": "hi"})
        assert (status, got["error"]) == (403, "token_invalid")
        assert "low-S" in got["reason"]


def _signed(header: dict[str, Any], claims: dict[str, Any], *, spaced: bool = False) -> str:
    """An HS256 token under the real secret; ``spaced``: JSON with spaces (another
    string for the same header and claims)."""
    seps = (", ", ": ") if spaced else (",", ":")
    head = _b64(json.dumps(header, separators=seps).encode())
    body = _b64(json.dumps(claims, separators=seps).encode())
    sig = hmac.new(SECRET.encode(), f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{_b64(sig)}"


async def test_crit_and_a_lifetime_past_the_maximum_are_refused(cluster, redis):
    async with access_stack(cluster, redis) as env, bystander(env):
        sid, _ = await env.worker.session()
        now = int(time.time())
        claims = {"sub": sid, "scope": "write", "iat": now, "exp": now + 300}
        crit = _signed({"alg": "HS256", "typ": "JWT", "kid": "k1", "crit": ["exp"]}, claims)
        forever = _signed({"alg": "HS256", "typ": "JWT", "kid": "k1"},
                          {**claims, "exp": now + 10**10})  # fmt: skip
        for token, said in ((crit, "crit"), (forever, "lifetime")):
            status, error, _ = await refused(await open_sse(env, sid, token))
            assert (status, error) == (403, "token_invalid"), said
            status, got, _ = await env.worker.post_turn(sid, token, {"message": "hi"})
            assert (status, got["error"]) == (403, "token_invalid")
            assert said in got["reason"]


async def test_two_spellings_of_one_token_share_its_stream_share(cluster, redis):
    """Streams are counted per token identity, not per string: the same claims in
    another JSON layout (a string that verifies) get no streams of their own."""
    async with access_stack(cluster, redis, relay={"max_streams_per_token": 4}) as env:
        sid, _ = await env.worker.session()
        now = int(time.time())
        claims = {"sub": sid, "scope": "watch", "iat": now, "exp": now + 300}
        header = {"alg": "HS256", "typ": "JWT", "kid": "k1"}
        plain, spaced = _signed(header, claims), _signed(header, claims, spaced=True)
        assert plain != spaced
        held = [await open_sse(env, sid, plain) for _ in range(4)]
        assert [r.status for r in held] == [200] * 4
        status, error, retry = await refused(await open_sse(env, sid, spaced))
        assert (status, error, retry) == (429, "too_many_streams", "5")
        # a jti makes another token: its own share
        other = _signed(header, {**claims, "jti": "second"})
        extra = await open_sse(env, sid, other)
        assert extra.status == 200
        for r in [*held, extra]:
            r.close()
