"""Accounting against the source of truth: every viewer compared with the session's
backlog in Redis, after a load test or a fault drill.

A viewer can only count what it saw; settling viewers against each other cannot see a
tail that no viewer got, nor a text that differs from what the engine produced. Here
the reference is what Redis holds: for each session, every frame of its backlog (the
last offset written and, per turn, the token texts and the terminal frame).

Order of use (after the drain, viewers stopped)::

    logs = await read_logs(redis, sids)          # I/O: one paged read per session
    counts = account(logs, viewers, posted)      # pure: the counters below

Counters (each summed over viewers or sessions; all must be 0):

- ``lost``: frames in the backlog a viewer never received (a merged frame covers its
  range; a range the server reported with a ``gap`` frame is not lost, it is counted in
  ``gaps_reported``);
- ``duplicated`` / ``out_of_order``: from the viewers' own tallies;
- ``content_mismatches``: a viewer's text of a turn it received whole differs from the
  backlog's text of that turn, the backlog's text differs from its ``done`` frame's ``chars`` /
  ``sha256``, or a viewer's check of a ``done`` frame failed;
- ``unended_turns``: turns in the backlog (or accepted with a 202) with no ``done`` or
  ``error`` frame in the backlog.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from redis.asyncio.cluster import RedisCluster

from bench.load.viewer import Viewer
from relay.broker.rediscluster.publisher import read_backlog

__all__ = ["SessionLog", "TurnLog", "account", "read_log", "read_logs"]

_PAGE = 1000


@dataclass
class TurnLog:
    """One turn as the backlog holds it."""

    pieces: list[str] = field(default_factory=list)
    end: str | None = None  # "done" or "error"
    done_meta: dict[str, Any] | None = None
    complete: bool = True  # False: the backlog was trimmed into this turn
    offsets: list[int] = field(default_factory=list)
    epochs: set[int] = field(default_factory=set)  # the generations that wrote it

    @property
    def text(self) -> str:
        return "".join(self.pieces)


@dataclass
class SessionLog:
    """A session's backlog: its bounds, the offsets it holds and its turns."""

    sid: str
    first: int = 1  # first offset still in the backlog
    last: int = 0  # last offset written
    offsets: set[int] = field(default_factory=set)
    turns: dict[int, TurnLog] = field(default_factory=dict)
    # where a writer after a failover skipped offsets the lost writes may have used
    failover_gaps: list[int] = field(default_factory=list)

    def add(self, frame: Mapping[str, Any]) -> None:
        offset, kind = int(frame["offset"]), str(frame["kind"])
        self.offsets.add(offset)
        turn = int(frame.get("turn", 0))
        if kind == "gap" and (frame.get("meta") or {}).get("code") == "lost_in_failover":
            self.failover_gaps.append(offset)
        if kind == "gap" or turn == 0:
            return
        t = self.turns.get(turn)
        if t is None:
            t = self.turns[turn] = TurnLog(complete=kind == "meta" or offset == 1)
        t.offsets.append(offset)
        t.epochs.add(int(frame.get("epoch", 0)))
        if kind == "token":
            t.pieces.append(str(frame.get("text", "")))
        elif kind in ("done", "error"):
            t.end = kind
            if kind == "done":
                t.done_meta = dict(frame.get("meta") or {})


async def read_log(redis: RedisCluster, sid: str) -> SessionLog:
    """Every frame of ``sid``'s backlog, in pages of ``_PAGE`` (one script call each)."""
    log = SessionLog(sid)
    after = 0
    while True:
        frames, first, last = await read_backlog(redis, sid, after, _PAGE)
        if after == 0:
            log.first, log.last = first, last
        for raw in frames:
            f = orjson.loads(raw)
            log.add(f)
            after = int(f["offset"])
        if len(frames) < _PAGE:
            return log


async def read_logs(redis: RedisCluster, sids: Iterable[str]) -> dict[str, SessionLog]:
    return {sid: await read_log(redis, sid) for sid in dict.fromkeys(sids)}


def _done_mismatch(t: TurnLog) -> bool:
    meta = t.done_meta or {}
    if "sha256" not in meta:
        return True  # a done frame must carry the hash
    digest = hashlib.sha256(t.text.encode("utf-8", "surrogatepass")).hexdigest()
    return digest != meta["sha256"] or len(t.text) != meta.get("chars")


def account(
    logs: Mapping[str, SessionLog],
    viewers: Sequence[Viewer],
    posted: Iterable[tuple[str, int]] = (),
) -> dict[str, Any]:
    """The counters of the module docstring, plus ``viewers_behind`` (viewers that never
    got their session's last offset), ``turns_checked`` and a few samples of what
    disagreed (``content_samples``)."""
    lost = behind = viewer_vs_log = checked = 0
    samples: list[str] = []
    for v in viewers:
        log = logs.get(v.sid)
        if log is None:
            continue
        t = v.tally
        missing = sum(1 for o in log.offsets if o > t.last or o in t.holes)
        lost += missing
        behind += t.last < log.last
        for turn, tl in log.turns.items():
            if not tl.complete or turn in v.gap_turns or tl.end is None:
                continue
            if any(o > t.last or o in t.holes for o in tl.offsets):
                continue  # frames of it were lost: counted as lost, not compared
            checked += 1
            got = "".join(v.turn_text.get(turn, []))
            if got != tl.text:
                viewer_vs_log += 1
                if len(samples) < 5:
                    samples.append(f"{v.sid}/{turn}: viewer {len(got)} chars, log {len(tl.text)}")
    log_vs_done = 0
    unended = 0
    for log in logs.values():
        for turn, tl in log.turns.items():
            if tl.end is None:
                unended += 1
            elif tl.end == "done" and tl.complete and _done_mismatch(tl):
                log_vs_done += 1
                if len(samples) < 5:
                    samples.append(f"{log.sid}/{turn}: backlog text disagrees with its done frame")
    for sid, turn in set(posted):  # accepted with a 202 but not in the backlog at all
        log = logs.get(sid)
        if log is not None and turn not in log.turns and turn >= min(log.turns, default=0):
            unended += 1
    lengths = [
        int((tl.done_meta or {}).get("tokens", 0))
        for log in logs.values()
        for tl in log.turns.values()
        if tl.end == "done"
    ]
    viewer_vs_done = sum(len(v.done_mismatches) for v in viewers)
    samples += [m for v in viewers for m in v.done_mismatches][: max(0, 5 - len(samples))]
    return {
        "lost": lost,
        "duplicated": sum(v.tally.duplicated for v in viewers),
        "out_of_order": sum(v.tally.out_of_order for v in viewers),
        "content_mismatches": viewer_vs_log + log_vs_done + viewer_vs_done,
        "content_detail": {
            "viewer_vs_backlog": viewer_vs_log,
            "backlog_vs_done": log_vs_done,
            "viewer_vs_done": viewer_vs_done,
        },
        "content_samples": samples,
        "unended_turns": unended,
        "viewers_behind": behind,
        "turns_checked": checked,
        "done_frames_checked": sum(v.done_checked for v in viewers),
        "backlog_frames": sum(len(log.offsets) for log in logs.values()),
        "reply_tokens_mean": round(sum(lengths) / len(lengths), 1) if lengths else None,
        "reply_tokens_max": max(lengths, default=None),
    }
