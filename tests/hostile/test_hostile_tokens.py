"""Hostile tokens against a real relay and a real worker: forged, expired, for another
session or signed with another secret; a token of one session never reads another.

What each test checks, with the harness of :mod:`tests.support.hostile`: the status or
close code and the documented reason, a bystander session unharmed, no crash logged.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import jwt
import orjson
import pytest
from yarl import URL

from relay.protocol.keys import new_session_id
from tests.support.hostile import bystander, get_json, raw_http, stack, tok
from tests.support.relay import STEP
from tests.support.sse import SSEClient
from tests.support.worker import SECRET

pytestmark = pytest.mark.integration


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
                    assert body["error"] in ("invalid_session", "token_wrong_session"), body
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
