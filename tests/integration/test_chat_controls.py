"""The chat controls on the worker, against the real cluster: stop (same worker, another
worker, a turn waiting for a slot, racing the engine's last token), regenerate and
edit, the conversation's load, delete. Every check reads what Redis holds (the backlog,
the history, the keys) rather than what a client saw."""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster

from relay.broker.rediscluster.publisher import read_backlog
from relay.broker.rediscluster.subscriber import ShardedSubscriber
from relay.protocol.frame import Frame, decode
from relay.protocol.keys import gone_key, hist_key, live_channel
from tests.support.worker import Harness, expected_reply, wait_turn

pytestmark = [pytest.mark.integration]

TERMINAL = ("done", "error")


async def _frames(redis: RedisCluster, sid: str) -> list[Frame]:
    raw, _, _ = await read_backlog(redis, sid, 0, 10_000)
    return [decode(x) for x in raw]


async def _history(redis: RedisCluster, sid: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in await redis.lrange(hist_key(sid), 0, -1)]


async def _call(
    h: Harness, method: str, path: str, token: str | None, body: Any = None
) -> tuple[int, dict[str, Any]]:
    assert h.http is not None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with h.http.request(method, h.url(path), json=body, headers=headers) as r:
        text = await r.text()
        return r.status, (json.loads(text) if text else {})


async def _wait_tokens(redis: RedisCluster, sid: str, turn: int, n: int = 1) -> None:
    for _ in range(400):
        if sum(f.kind == "token" and f.turn == turn for f in await _frames(redis, sid)) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no token frame")


@pytest.fixture
async def slow(h: Harness) -> Harness:
    """A worker on one engine that decodes 50 tokens/s (a reply lasts seconds)."""
    await h.start_engines(1, decode_tok_per_s=50.0)
    await h.start_worker()
    return h


async def test_a_stop_ends_the_turn_with_one_done_frame_and_keeps_the_partial_reply(
    slow: Harness, redis: RedisCluster
) -> None:
    h = slow
    sid, token = await h.session()
    status, body, _ = await h.post_turn(
        sid, token, {"message": "tell me a long story", "max_tokens": 400}
    )
    assert status == 202, body
    turn = body["turn"]
    await _wait_tokens(redis, sid, turn, 2)
    status, ack = await _call(h, "POST", f"/v1/sessions/{sid}/turns/{turn}/cancel", token)
    assert (status, ack["status"]) == (202, "stopping"), ack
    frames = await wait_turn(redis, sid, turn)
    assert [f.kind for f in frames].count("done") == 1
    assert sum(f.kind in TERMINAL for f in frames) == 1
    done = frames[-1]
    assert done.kind == "done"
    assert done.meta is not None
    assert done.meta["finish_reason"] == "cancelled"
    text = "".join(f.text for f in frames if f.kind == "token")
    assert done.meta["chars"] == len(text)
    assert done.meta["sha256"] == hashlib.sha256(text.encode()).hexdigest()
    hist = await _history(redis, sid)
    assert hist[-1]["content"] == text
    assert hist[-1]["finish"] == "cancelled"
    assert hist[-1]["to"] == done.offset
    assert hist[-2]["from"] == frames[0].offset
    # idempotent: the same answer, now with the terminal offset
    for _ in range(2):
        status, again = await _call(h, "POST", f"/v1/sessions/{sid}/turns/{turn}/cancel", token)
        assert (status, again["status"]) == (202, "stopped"), again
        assert again["offset"] == done.offset
    # the engine saw the request aborted
    await asyncio.sleep(0.2)
    assert h.engines[0].engine.metrics.aborted._value.get() >= 1
    # the next turn's prompt holds the partial reply: the session goes on
    status, body, _ = await h.post_turn(sid, token, {"message": "go on", "max_tokens": 4})
    assert status == 202, body


async def test_stop_refusals_and_a_bystander_session_that_keeps_streaming(
    slow: Harness, redis: RedisCluster
) -> None:
    h = slow
    sid, token = await h.session()
    other, other_token = await h.session()
    status, body, _ = await h.post_turn(
        other, other_token, {"message": "bystander", "max_tokens": 60}
    )
    assert status == 202
    bystander = body["turn"]
    # nothing runs yet in sid
    status, err = await _call(h, "POST", f"/v1/sessions/{sid}/cancel", token)
    assert (status, err["error"]) == (409, "no_turn_running"), err
    status, err = await _call(h, "POST", f"/v1/sessions/{sid}/turns/7/cancel", token)
    assert (status, err["error"]) == (404, "unknown_turn"), err
    status, err = await _call(h, "POST", f"/v1/sessions/{sid}/turns/x/cancel", token)
    assert (status, err["error"]) == (400, "invalid_turn"), err
    status, err = await _call(h, "POST", f"/v1/sessions/{other}/turns/{bystander}/cancel", token)
    assert status == 403, err
    status, body, _ = await h.post_turn(sid, token, {"message": "short", "max_tokens": 3})
    assert status == 202
    frames = await wait_turn(redis, sid, body["turn"])
    status, err = await _call(h, "POST", f"/v1/sessions/{sid}/turns/{body['turn']}/cancel", token)
    assert (status, err["error"]) == (409, "turn_finished"), err
    assert err["offset"] == frames[-1].offset
    status, err = await _call(h, "POST", f"/v1/sessions/{sid}/turns/1/cancel", None)
    assert status == 401
    done = await wait_turn(redis, other, bystander, timeout_s=30)
    assert done[-1].kind == "done"
    assert done[-1].meta is not None
    assert done[-1].meta["finish_reason"] != "cancelled"


async def test_a_stop_taken_by_another_worker_reaches_the_one_that_runs_the_turn(
    h: Harness, redis: RedisCluster
) -> None:
    await h.start_engines(1, decode_tok_per_s=50.0)
    await h.start_worker(worker_id="runner")
    other = Harness(redis, engines=h.engines)
    await other.start_worker(worker_id="stopper")
    try:
        sid, token = await h.session()
        status, body, _ = await h.post_turn(sid, token, {"message": "long", "max_tokens": 400})
        assert status == 202
        turn = body["turn"]
        await _wait_tokens(redis, sid, turn, 2)
        status, ack = await _call(other, "POST", f"/v1/sessions/{sid}/cancel", token)
        assert status == 202
        assert ack == {"session": sid, "turn": turn, "status": "stopping"}
        frames = await wait_turn(redis, sid, turn, timeout_s=5)
        assert frames[-1].meta is not None
        assert frames[-1].meta["finish_reason"] == "cancelled"
        assert h.state.turns.control.received == 1  # by the notification, not the refresh
    finally:
        other.engines = []  # the engines are h's to stop
        await other.stop()


async def test_a_stop_takes_a_turn_out_of_the_wait_for_an_engine_slot(
    h: Harness, redis: RedisCluster
) -> None:
    await h.start_engines(1, decode_tok_per_s=8.0)  # the busy turn holds its slot for seconds
    await h.start_worker(cap=1, admit_wait_s=8.0, route_queue=0.0)
    busy, busy_token = await h.session()
    sid, token = await h.session()
    status, _body, _ = await h.post_turn(
        busy, busy_token, {"message": "hold the slot", "max_tokens": 400}
    )
    assert status == 202
    waiting = asyncio.ensure_future(h.post_turn(sid, token, {"message": "wait", "max_tokens": 4}))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    status, ack = await _call(h, "POST", f"/v1/sessions/{sid}/cancel", token)
    assert (status, ack["turn"]) == (202, 0), ack
    status, err, _ = await asyncio.wait_for(waiting, 2.0)
    assert (status, err["error"]) == (409, "turn_cancelled"), err
    assert await _frames(redis, sid) == []  # it never started: no frame at all
    await _call(h, "POST", f"/v1/sessions/{busy}/cancel", busy_token)


@pytest.mark.timeout(120)
async def test_a_stop_racing_the_last_token_gives_exactly_one_terminal_frame(
    h: Harness, redis: RedisCluster
) -> None:
    await h.start_engines(1, decode_tok_per_s=400.0)
    await h.start_worker()
    sid, token = await h.session()
    outcomes: dict[str, int] = {}
    for i in range(30):
        status, body, _ = await h.post_turn(sid, token, {"message": f"race {i}", "max_tokens": 8})
        assert status == 202, body
        turn = body["turn"]
        await asyncio.sleep(0.004 * (i % 10))  # from before the first token to past the end
        status, ack = await _call(h, "POST", f"/v1/sessions/{sid}/turns/{turn}/cancel", token)
        assert status in (202, 409), ack
        frames = await wait_turn(redis, sid, turn)
        kinds = [f.kind for f in frames]
        assert (sum(k in TERMINAL for k in kinds), kinds[-1]) == (1, "done"), kinds
        assert frames[-1].meta is not None
        finish = frames[-1].meta["finish_reason"]
        outcomes[finish] = outcomes.get(finish, 0) + 1
        if status == 409:
            assert finish != "cancelled"
            assert ack["offset"] == frames[-1].offset
        # what a later stop answers agrees with the terminal frame
        status, later = await _call(h, "POST", f"/v1/sessions/{sid}/turns/{turn}/cancel", token)
        if finish == "cancelled":
            assert (status, later["status"], later["offset"]) == (202, "stopped", frames[-1].offset)
        else:
            assert (status, later["error"]) == (409, "turn_finished"), later
        for _ in range(100):  # the lock goes with the terminal frame's round trip
            if sid not in h.state.turns.running:
                break
            await asyncio.sleep(0.01)
    assert sum(outcomes.values()) == 30
    assert outcomes.get("cancelled", 0) > 0, outcomes


async def test_regenerate_and_edit_replace_turns_in_the_history_and_say_so(
    h: Harness, redis: RedisCluster
) -> None:
    await h.start_engines(1)
    await h.start_worker()
    sid, token = await h.session()
    status, err, _ = await h.post_turn(sid, token, {"regenerate": True})
    assert (status, err["error"]) == (409, "nothing_to_regenerate"), err
    for text in ("first", "second"):
        status, body, _ = await h.post_turn(sid, token, {"message": text, "max_tokens": 6})
        assert status == 202
        await wait_turn(redis, sid, body["turn"])
    before = await _history(redis, sid)
    status, body, _ = await h.post_turn(sid, token, {"regenerate": True, "max_tokens": 6})
    assert status == 202, body
    frames = await wait_turn(redis, sid, body["turn"])
    assert frames[0].meta is not None
    assert frames[0].meta["replaces"] == 2
    assert frames[0].meta["message"] == "second"
    # another reply, as a sampling engine gives: the worker sends the mock engine the
    # regenerating turn's number (X-Reply-Seed), and the mock mixes it in
    replaced = before[3]["content"]
    prompt = [{"role": m["role"], "content": m["content"]} for m in before[:3]]
    assert replaced == expected_reply(prompt, 6)
    again = "".join(f.text for f in frames if f.kind == "token")
    assert again != replaced
    assert again == expected_reply(prompt, 6, seed=body["turn"])
    hist = await _history(redis, sid)
    assert [(m["turn"], m["role"]) for m in hist] == [
        (1, "user"),
        (1, "assistant"),
        (3, "user"),
        (3, "assistant"),
    ]
    status, body, _ = await h.post_turn(
        sid, token, {"replaces": 1, "message": "first, edited", "max_tokens": 6}
    )
    assert status == 202, body
    frames = await wait_turn(redis, sid, body["turn"])
    assert frames[0].meta is not None
    assert frames[0].meta["replaces"] == 1
    hist = await _history(redis, sid)
    assert [(m["turn"], m["content"]) for m in hist if m["role"] == "user"] == [
        (4, "first, edited")
    ]
    status, err, _ = await h.post_turn(sid, token, {"replaces": 99, "message": "x"})
    assert (status, err["error"]) == (404, "unknown_turn"), err
    status, err, _ = await h.post_turn(sid, token, {"regenerate": True, "message": "x"})
    assert status == 400, err


async def test_load_and_watch_meet_with_no_gap_and_no_duplicate_while_a_turn_runs(
    slow: Harness, redis: RedisCluster
) -> None:
    h = slow
    sid, token = await h.session()
    for text in ("one", "two"):
        status, body, _ = await h.post_turn(sid, token, {"message": text, "max_tokens": 5})
        await wait_turn(redis, sid, body["turn"])
    status, body, _ = await h.post_turn(sid, token, {"message": "three", "max_tokens": 60})
    running = body["turn"]
    await _wait_tokens(redis, sid, running, 1)
    status, page = await _call(h, "GET", f"/v1/sessions/{sid}/messages", token)
    assert status == 200, page
    assert page["running"] == {"turn": running, "offset": body["offset"]}
    assert {m["turn"] for m in page["messages"]} == {1, 2}
    await wait_turn(redis, sid, running)
    after = [f for f in await _frames(redis, sid) if f.offset > page["resume_from"]]
    assert after[0].offset == page["resume_from"] + 1
    assert after[0].turn == running
    assert {f.turn for f in after} == {running}
    # idle: the page covers everything, the watch starts after the last frame
    status, page = await _call(h, "GET", f"/v1/sessions/{sid}/messages?limit=2", token)
    assert page["running"] is None
    assert page["resume_from"] == (await _frames(redis, sid))[-1].offset
    assert [m["turn"] for m in page["messages"]] == [2, 2, 3, 3]
    assert page["next_before"] == 2
    status, older = await _call(h, "GET", f"/v1/sessions/{sid}/messages?limit=2&before=2", token)
    assert [m["turn"] for m in older["messages"]] == [1, 1]
    assert older["next_before"] is None
    status, ui = await _call(h, "GET", f"/v1/sessions/{sid}/messages?format=ui", token)
    assert ui["messages"][1]["parts"][0]["type"] == "text"
    assert ui["messages"][1]["id"] == f"{sid}-1"
    status, err = await _call(h, "GET", f"/v1/sessions/{sid}/messages?limit=0", token)
    assert (status, err["error"]) == (400, "invalid_page")


async def test_delete_stops_the_turn_removes_every_key_and_refuses_the_tokens(
    slow: Harness, redis: RedisCluster
) -> None:
    h = slow
    sid, token = await h.session()
    other, other_token = await h.session()
    status, body, _ = await h.post_turn(
        other, other_token, {"message": "bystander", "max_tokens": 40}
    )
    bystander = body["turn"]
    status, body, _ = await h.post_turn(sid, token, {"message": "to be deleted", "max_tokens": 400},
                                        headers={"Idempotency-Key": "k1"})  # fmt: skip
    await _wait_tokens(redis, sid, body["turn"], 1)
    status, _ = await _call(h, "DELETE", f"/v1/sessions/{sid}", token)
    assert status == 204
    left = []
    for node in redis.get_primaries():
        async for k in redis.scan_iter(match=f"tr:{{{sid}}}:*", target_nodes=node):
            left.append(k.decode())
    assert left == [gone_key(sid)], left
    status, err, _ = await h.post_turn(sid, token, {"message": "again"})
    assert (status, err["error"]) == (410, "session_deleted"), err
    status, err = await _call(h, "GET", f"/v1/sessions/{sid}/messages", token)
    assert status == 410
    status, err = await _call(h, "DELETE", f"/v1/sessions/{sid}", token)
    assert (status, err["error"]) == (404, "unknown_session"), err
    done = await wait_turn(redis, other, bystander, timeout_s=30)
    assert done[-1].kind == "done"


async def test_delete_tells_the_relays(h: Harness, redis: RedisCluster) -> None:
    """The deleted frame goes out on the session's live channel (a relay's subscriber)."""
    await h.start_engines(1)
    await h.start_worker()
    sid, token = await h.session()
    got: list[bytes] = []
    sub = ShardedSubscriber(
        redis,
        on_message=lambda msgs: got.extend(m[2] for m in msgs),
        on_resubscribed=lambda _c: None,
        relay_id="test-delete",
    )
    await sub.start()
    try:
        await sub.subscribe([live_channel(sid)])
        status, _ = await _call(h, "DELETE", f"/v1/sessions/{sid}", token)
        assert status == 204
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.02)
    finally:
        await sub.close()
    assert got
    assert decode(got[0]).meta == {"code": "session_deleted"}


async def test_the_ai_sdk_chat_edits_and_regenerates_by_message_id(
    h: Harness, redis: RedisCluster
) -> None:
    """/v1/chat: a submit-message whose messageId is a stored message edits it; an
    unknown one is 404 unknown_message; regenerate-message replaces the newest reply."""
    await h.start_engines(1)
    await h.start_worker()
    sid, token = await h.session()
    assert h.http is not None
    headers = {"Authorization": f"Bearer {token}"}

    async def chat(body: dict[str, Any]) -> tuple[int, str]:
        assert h.http is not None
        async with h.http.post(h.url("/v1/chat"), json=body, headers=headers) as r:
            return r.status, await r.text()

    user = {"id": "u-1", "role": "user", "parts": [{"type": "text", "text": "hello"}]}
    status, _ = await chat({"id": sid, "messages": [user]})
    assert status == 200
    status, text = await chat({"id": sid, "trigger": "regenerate-message", "messages": []})
    assert status == 200, text
    hist = await _history(redis, sid)
    assert [(m["turn"], m["role"], m.get("id")) for m in hist] == [
        (2, "user", "u-1"), (2, "assistant", f"{sid}-2")
    ]  # fmt: skip
    edited = {**user, "parts": [{"type": "text", "text": "hello, edited"}]}
    status, text = await chat({"id": sid, "messageId": "u-1", "messages": [edited]})
    assert status == 200, text
    hist = await _history(redis, sid)
    assert [(m["turn"], m["content"]) for m in hist if m["role"] == "user"] == [
        (3, "hello, edited")
    ]
    status, text = await chat({"id": sid, "messageId": "nope", "messages": [edited]})
    assert status == 404
    assert json.loads(text)["error"] == "unknown_message"
