"""One gateway key against another's responses, on a real worker and a real relay that
hold two gateway keys (the style of tests/hostile/test_hostile_access.py: a bystander
session gets every frame, nothing is logged as a crash).

A response and its conversation belong to the key that created them, as OpenAI scopes a
response to its project: the other key reads, streams, continues
(``previous_response_id``, ``conversation``), cancels and deletes nothing of it, and
every answer is the 404 an id that never existed gets, with nothing of the prompt or the
instructions in it. The session's record holds a keyed digest of the key, never the key.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from relay.fronts.responses.wire import parse_response_id
from relay.protocol.keys import owner_key
from tests.hostile.test_hostile_access import access_stack
from tests.support.hostile import Env, bystander

pytestmark = pytest.mark.integration

KEY1 = "gateway-key-one-7c2f1e9a4b5d6083"
KEY2 = "gateway-key-two-0e4d8b1a6c3f2957"
MODEL = "tokenrelay-mock"
SECRET_PROMPT = "the launch code is 0451-PLOVER"
SECRET_INSTRUCTIONS = "You guard the vault of Zembla."


async def _call(
    env: Env, method: str, path: str, key: str, body: Any = None, *, relay: bool = False
) -> tuple[int, dict[str, Any], str]:
    http = env.relay.http if relay else env.worker.http
    assert http is not None
    url = env.relay.base + path if relay else env.worker.url(path)
    async with http.request(
        method, url, json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        text = await r.text()
        try:
            parsed: dict[str, Any] = json.loads(text)
        except ValueError:  # an event stream
            parsed = {}
        return r.status, parsed, text


def _create(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": SECRET_PROMPT, "instructions": SECRET_INSTRUCTIONS,
            "max_output_tokens": 8, **kw}  # fmt: skip


async def _attempts(env: Env, rid: str, key: str) -> dict[str, tuple[int, dict[str, Any], str]]:
    """Every route of a response, with ``key``: what each answered."""
    sid = parse_response_id(rid).session
    relay_path = f"/v1/responses/{rid}?stream=true&starting_after=0"
    return {
        "get": await _call(env, "GET", f"/v1/responses/{rid}", key),
        "stream": await _call(env, "GET", f"/v1/responses/{rid}?stream=true", key),
        "relay stream": await _call(env, "GET", relay_path, key, relay=True),
        "input items": await _call(env, "GET", f"/v1/responses/{rid}/input_items", key),
        "continue": await _call(
            env, "POST", "/v1/responses", key, _create(previous_response_id=rid)
        ),
        "conversation": await _call(
            env, "POST", "/v1/responses", key, _create(conversation=f"conv_{sid}")
        ),
        "cancel": await _call(env, "POST", f"/v1/responses/{rid}/cancel", key),
        "delete": await _call(env, "DELETE", f"/v1/responses/{rid}", key),
    }


def _as_if_unknown(route: str, got: tuple[int, dict[str, Any], str]) -> None:
    status, body, text = got
    assert status == 404, (route, status, text)
    assert body["error"]["type"] == "not_found_error" or body["error"]["code"] in (
        "response_not_found", "not_found"), (route, body)  # fmt: skip
    assert "0451" not in text, (route, text)
    assert "Zembla" not in text, (route, text)


async def test_a_gateway_key_reaches_no_response_of_another_key(cluster, redis) -> None:
    keys = {"gateway_keys": (KEY1, KEY2)}
    async with access_stack(cluster, redis, worker=keys, relay=keys) as env, bystander(env):
        status, made, text = await _call(env, "POST", "/v1/responses", KEY1, _create())
        assert status == 200, text
        rid = made["id"]
        sid = parse_response_id(rid).session

        # the other key: every route answers as for an id that never existed
        fake = f"resp_{sid}x_1_1"
        for route, got in (await _attempts(env, fake, KEY2)).items():
            assert got[0] == 404, (route, got)
        for route, got in (await _attempts(env, rid, KEY2)).items():
            _as_if_unknown(route, got)

        # ... and changed nothing: the owner reads it whole, continues it, streams it
        status, again, text = await _call(env, "GET", f"/v1/responses/{rid}", KEY1)
        assert status == 200, text
        assert again["status"] == made["status"]
        assert again["instructions"] == SECRET_INSTRUCTIONS
        status, items, text = await _call(env, "GET", f"/v1/responses/{rid}/input_items", KEY1)
        assert (status, items["data"][0]["content"][0]["text"]) == (200, SECRET_PROMPT), text
        status, _, text = await _call(env, "GET", f"/v1/responses/{rid}?stream=true",
                                      KEY1, relay=True)  # fmt: skip
        assert status == 200, text
        assert "response.completed" in text or "response.incomplete" in text
        status, nxt, text = await _call(env, "POST", "/v1/responses", KEY1,
                                        _create(previous_response_id=rid))  # fmt: skip
        assert status == 200, text
        assert parse_response_id(nxt["id"]).session == sid

        # the record holds a keyed digest of the key, not the key
        state = await redis.hgetall(owner_key(sid))
        stored = b" ".join(k + b"=" + v for k, v in state.items())
        assert KEY1.encode() not in stored
        assert KEY2.encode() not in stored
        assert b"api=responses:" in stored

        # the owner deletes it; the other key could not
        status, gone, text = await _call(env, "DELETE", f"/v1/responses/{rid}", KEY1)
        assert (status, gone["deleted"]) == (200, True), text


async def test_a_gateway_key_cannot_cancel_another_keys_running_response(cluster, redis) -> None:
    keys = {"gateway_keys": (KEY1, KEY2)}
    async with access_stack(cluster, redis, worker=keys, relay=keys) as env, bystander(env):
        long = _create(max_output_tokens=400, background=True)
        status, made, text = await _call(env, "POST", "/v1/responses", KEY1, long)
        assert status == 200, text
        rid = made["id"]
        status, body, text = await _call(env, "POST", f"/v1/responses/{rid}/cancel", KEY2)
        _as_if_unknown("cancel", (status, body, text))
        status, body, text = await _call(env, "DELETE", f"/v1/responses/{rid}", KEY2)
        _as_if_unknown("delete", (status, body, text))
        for _ in range(200):  # the turn runs to its own end: not cancelled, not deleted
            status, obj, text = await _call(env, "GET", f"/v1/responses/{rid}", KEY1)
            assert status == 200, text
            if obj["status"] != "in_progress":
                break
            await asyncio.sleep(0.05)
        assert obj["status"] in ("completed", "incomplete"), obj["status"]
        assert obj.get("incomplete_details") in (None, {"reason": "max_output_tokens"})
