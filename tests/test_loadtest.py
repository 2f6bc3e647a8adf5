"""The load test's own counting (pure), then a small run end to end on a stack of its own."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
import pytest

from bench.accounting import SessionLog, account
from bench.loadtest import LoadConfig, run_loadtest
from bench.viewer import OffsetTally, Viewer, check_done
from devstack.demo.stack import StackSpec
from relay.protocol.frame import decode
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
