"""The load test's own counting (pure), its viewer on a scripted relay (through the Python
client), then a small run end to end on a stack of its own."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from bench.load.accounting import SessionLog, account
from bench.load.loadtest import LoadConfig, run_loadtest
from bench.load.viewer import OffsetTally, Viewer, check_done
from devstack.demo.stack import StackSpec
from relay.protocol.frame import decode
from tests.support.http import serve
from worker.chat.turnstate import reply_integrity


def test_a_missing_tail_is_lost_not_silently_ignored() -> None:
    t = OffsetTally()
    for off in (1, 2, 4):
        t.feed(off)
    assert t.lost == 1  # the hole at 3
    assert t.settle(6) == 2  # 5 and 6 never arrived: the session went on to 6
    assert t.lost == 3
    assert t.settle(6) == 0  # idempotent


def test_a_reported_gap_is_not_lost() -> None:
    t = OffsetTally()
    t.feed(1)
    t.gap(2, 5, 5)  # the server said 2..5 are gone
    t.feed(6)
    assert (t.lost, t.gaps_reported) == (0, 1)


def test_a_merged_frame_covers_its_range() -> None:
    t = OffsetTally()
    t.feed(1)
    assert t.feed(5, first=2)  # merged 2..5: nothing missing
    assert (t.lost, t.duplicated, t.last) == (0, 0, 5)
    assert not t.feed(5, first=3)  # the same range again: a duplicate
    assert t.feed(9, first=8)  # 6 and 7 never came
    assert (t.lost, t.duplicated) == (2, 1)
    assert t.feed(7, first=6)  # late: fills the hole
    assert (t.lost, t.out_of_order) == (0, 1)


def test_check_done_catches_a_changed_a_missing_or_an_extra_token() -> None:
    pieces = ["Héllo", " wörld", " 🙂"]
    meta = reply_integrity("".join(pieces), 3)
    assert meta["chars"] == 13  # code points, not UTF-16 units or bytes
    assert meta["sha256"] == hashlib.sha256("Héllo wörld 🙂".encode()).hexdigest()
    assert check_done(meta, pieces, 3) == []
    assert check_done(meta, pieces, None) == []  # a merge hid the count: text still checked
    assert check_done(meta, pieces[:2], 2) == ["sha256", "chars", "tokens"]
    assert check_done(meta, ["Hello", " wörld", " 🙂"], 3) == ["sha256"]  # same length


def _frame(sid: str, turn: int, off: int, kind: str, text: str = "", **meta: Any) -> bytes:
    return orjson.dumps(
        {"v": 1, "session": sid, "turn": turn, "offset": off, "kind": kind, "text": text,
         "epoch": turn, "ts": 0, "meta": meta or None}
    )  # fmt: skip


def _turn(sid: str, turn: int, first: int, pieces: list[str]) -> list[bytes]:
    out = [_frame(sid, turn, first, "meta")]
    out += [_frame(sid, turn, first + 1 + i, "token", p) for i, p in enumerate(pieces)]
    done = reply_integrity("".join(pieces), len(pieces))
    return [*out, _frame(sid, turn, first + 1 + len(pieces), "done", **done)]


def test_accounting_compares_each_viewer_with_the_backlog() -> None:
    frames = _turn("s", 1, 1, ["a", "b", "c"]) + _turn("s", 2, 6, ["d", "e"])
    log = SessionLog("s", first=1, last=9)
    for raw in frames:
        log.add(orjson.loads(raw))

    def viewer(raws: list[bytes]) -> Viewer:
        v = Viewer(None, list, "s", "t")  # type: ignore[arg-type]
        for raw in raws:
            v.delivered(decode(raw), 0.0)
        return v

    clean = viewer(frames)
    tail_missing = viewer(frames[:-2])  # the last token and the done never arrived
    altered = viewer([*frames[:2], _frame("s", 1, 3, "token", "X"), *frames[3:]])
    r = account({"s": log}, [clean, tail_missing, altered], posted=[("s", 1), ("s", 2), ("s", 3)])
    assert r["lost"] == 2
    assert r["viewers_behind"] == 1
    # altered: its text differs from the backlog's and fails the done frame's check
    assert r["content_detail"] == {"viewer_vs_backlog": 1, "backlog_vs_done": 0,
                                   "viewer_vs_done": 1}  # fmt: skip
    assert r["unended_turns"] == 1  # turn 3 was accepted but never reached the backlog
    assert r["reply_tokens_mean"] == 2.5

    bad_log = SessionLog("s", first=1, last=9)
    for raw in frames[:-1]:  # turn 2 without its done frame
        bad_log.add(orjson.loads(raw))
    assert account({"s": bad_log}, [])["unended_turns"] == 1


@pytest.fixture
async def scripted_relay() -> AsyncIterator[tuple[str, list[str | None]]]:
    """SSE on loopback: a duplicate, a hole filled late and a wrong ``done`` hash, then
    the stream ends; a 404; then the next turn, open until the viewer leaves."""
    resumes: list[str | None] = []
    turn2 = _turn("s", 2, 6, ["x"])
    scripts = {
        1: [*_turn("s", 1, 1, ["a"])[:2], _frame("s", 1, 2, "token", "a"),
            _frame("s", 1, 4, "token", "c"), _frame("s", 1, 3, "token", "b"),
            _frame("s", 1, 5, "done", chars=3, sha256="0" * 64)],
        3: turn2,
    }  # fmt: skip

    async def events(request: web.Request) -> web.StreamResponse:
        resumes.append(request.headers.get("Last-Event-ID"))
        n = len(resumes)
        if n == 2:
            return web.json_response({"error": "not_found", "reason": "gone"}, status=404)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'event: hello\ndata: {"relay": "r%d"}\n\n' % n)
        for raw in scripts.get(n, []):
            await resp.write(b"data: %s\n\n" % raw)
        if n >= 3:
            for _ in range(200):  # a heartbeat until the viewer hangs up
                await asyncio.sleep(0.05)
                try:
                    await resp.write(b": ping\n\n")
                except (ConnectionError, aiohttp.ClientConnectionResetError):
                    break
        return resp

    app = web.Application()
    app.router.add_get("/v1/sessions/s/events", events)
    async with serve(app) as url:
        yield url, resumes


@pytest.mark.timeout(30)
async def test_the_viewer_counts_what_the_client_drops_and_watches_on(
    scripted_relay: tuple[str, list[str | None]],
) -> None:
    url, resumes = scripted_relay
    stop = asyncio.Event()

    def on_frame(_: Viewer, frame: dict[str, Any]) -> None:
        if (frame["kind"], frame["turn"]) == ("done", 2):
            stop.set()

    async with aiohttp.ClientSession() as http:
        v = Viewer(http, lambda: [url], "s", "t", on_frame=on_frame)
        async with asyncio.timeout(20):
            await v.run(stop)
    t = v.tally
    # the client drops the second 2 and the late 3 and reports the hole: all counted here
    assert (t.frames, t.duplicated, t.out_of_order, t.lost, t.last) == (9, 1, 1, 0, 8)
    assert v.problems == {"missing": 1}
    # a wrong hash (the client would raise without a handler) and a 404 (it raises
    # WatchRefused): counted, and the viewer watched on from where it was
    assert (v.done_checked, v.done_mismatches) == (2, ["turn 1: sha256"])
    assert len(v.errors) == 1
    assert v.errors[0].startswith("WatchRefused: 404 not_found")
    assert resumes == ["0", "5", "5"]
    assert (v.connects, v.relay_ids) == (2, ["r1", "r3"])
    assert sorted(v.turn_first_token) == [1, 2]
    assert len(v.recoveries_ms) == 1  # one disconnect (the end, the 404) to the next frame


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_small_load_run_counts_every_frame_and_ends_clean() -> None:
    cfg = LoadConfig(
        duration_s=6.0, viewers=24, screens_per_session=4, turns_per_s=2.0, max_tokens=20,
        progress=False, max_turns=10, seed=7,
    )  # fmt: skip
    r = await run_loadtest(cfg, StackSpec(relays=2, workers=2, engines=2, abuse_limits=False))
    assert r["connected_at_start"] == 24
    assert 0 < r["turns"] <= 10
    assert (r["lost"], r["duplicated"], r["out_of_order"], r["errors"]) == (0, 0, 0, 0), r
    assert (r["content_mismatches"], r["unended_turns"]) == (0, 0), r
    assert r["turns_checked"] >= r["turns"] * 4 > 0  # every screen's text vs the backlog
    assert r["done_frames_checked"] >= r["turns"] * 4
    assert r["viewers_behind"] == 0, r
    assert (r["leases_held_end"], r["subscriptions_end"]) == (0, 0), r
    assert r["tokens_per_s"] >= r["token_frames_per_s"] > 0  # frames carry >= 1 token
    assert r["ttft_p50_ms"] > 0
    assert r["relay_cpu_s"] is not None  # our own stack: measured, not assumed idle
    assert r["relay_cpu_s"] > 0
