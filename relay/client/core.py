"""The pure parts of the Python client (:mod:`relay.client.stream`): continuity and
integrity checks, reconnect backoff. No sockets, no clock, no asyncio. SSE is decoded
by :mod:`relay.protocol.sse_reader`, the project's one SSE decoder.

The same rules as the browser client (clients/js/tokenrelay.js):

- a frame at or below the last delivered offset is a duplicate: dropped, counted;
- a frame whose first offset (``meta.from`` for a merged token frame) is above
  ``last + 1`` leaves a hole: problem ``missing``; a merged frame whose ``meta.merged``
  is not ``offset - meta.from + 1``: ``merge``; one that starts at or below ``last``:
  ``overlap``; a ``gap`` frame from the relay: ``gap`` (it is delivered too);
- a ``reset`` frame (the session's keys expired and restarted) is delivered, and the
  offsets start again: the next frame is offset 1 of the new generation;
- a ``presence`` frame (how many screens watch, offset 0) is delivered as it comes: it
  is outside the offsets, never a duplicate or a hole;
- the generation of the frames delivered (``meta.gen``, and a ``reset``'s new one) is
  kept in ``gen``: a client sends it with its resume offset, so that a relay can tell
  an offset of an older generation from one of the current;
- for a turn watched from its ``meta`` frame, the ``done`` frame's ``meta.chars``
  (Unicode code points) and ``meta.sha256`` (hex SHA-256 of the UTF-8 reply) are
  compared with the text received, and its ``meta.parts`` / ``meta.parts_sha256`` with
  the parts received (:func:`relay.protocol.parts.parts_digest`), when present:
  ``integrity``;
- a ``part`` frame that does not fit its turn's parts (an unknown type, a delta for a
  part never started, a tool call's arguments that are not JSON at its end, a part after
  the turn's terminal frame: :class:`relay.protocol.parts.Parts`) is not delivered
  (its offset counts as received): problem ``part``, with the reason.

Order of use: ``c = Continuity(after, gen)``; per decoded frame ``deliver, problems =
c.accept(frame)``; ``c.last`` and ``c.gen`` to resume; :func:`backoff_s` before each
reconnect.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

from relay.protocol.frame import Frame, first_offset, frame_gen
from relay.protocol.parts import PartError, Parts, frame_part, parts_digest

__all__ = [
    "Continuity",
    "Problem",
    "ProblemReason",
    "backoff_s",
    "check_done",
]

ProblemReason = Literal["gap", "missing", "merge", "overlap", "integrity", "part"]


@dataclass(frozen=True, slots=True)
class Problem:
    """Text that is missing or wrong: ``from_offset..to_offset`` (either may be None)."""

    reason: ProblemReason
    from_offset: int | None
    to_offset: int | None
    turn: int | None
    detail: str


@dataclass(slots=True)
class _Turn:
    text: list[str] = field(default_factory=list)
    whole: bool = True
    parts: Parts = field(default_factory=Parts)


class Continuity:
    """One session's frames as a client receives them (see the module docstring)."""

    MAX_TURNS = 8  # turns tracked at once (a turn ends with done/error)

    def __init__(self, after: int | None = None, gen: str | None = None) -> None:
        self.last = after  # last offset delivered; None: nothing yet (live)
        self.gen = gen  # the generation of the frames delivered; None: not known yet
        self.duplicates = 0
        self.problems = 0
        self._turns: OrderedDict[int, _Turn] = OrderedDict()
        self._ended: OrderedDict[int, None] = OrderedDict()  # turns whose terminal frame came

    def accept(self, frame: Frame) -> tuple[bool, list[Problem]]:
        """Whether to deliver ``frame``, and the problems it reveals."""
        deliver, problems = self._accept(frame)
        if deliver and (gen := frame_gen(frame)):
            self.gen = gen  # a reset's meta.gen is the new generation
        return deliver, problems

    def _accept(self, frame: Frame) -> tuple[bool, list[Problem]]:
        problems: list[Problem] = []
        if frame.kind == "gap":
            m = frame.meta or {}
            problems.append(
                Problem("gap", m.get("from"), m.get("to", frame.offset), None, frame.text)
            )
            self._break_all()
            if self.last is None or frame.offset > self.last:
                self.last = frame.offset
            return self._done(True, problems)
        if frame.kind == "presence":  # how many screens watch: outside the offsets
            return self._done(True, problems)
        if frame.kind == "reset":  # a new generation: its offsets begin again at 1
            self._turns.clear()
            self.last = 0
            return self._done(True, problems)
        if self.last is not None and frame.offset <= self.last:
            self.duplicates += 1
            return False, problems
        first = first_offset(frame)
        merged = (frame.meta or {}).get("merged") if frame.kind in ("token", "part") else None
        if isinstance(merged, int) and merged != frame.offset - first + 1:
            problems.append(
                Problem("merge", first, frame.offset, frame.turn,
                        f"meta.merged {merged} but meta.from..offset covers "
                        f"{frame.offset - first + 1}")
            )  # fmt: skip
        if self.last is not None and first > self.last + 1:
            problems.append(
                Problem("missing", self.last + 1, first - 1, frame.turn, "offsets skipped")
            )
            self._break_all()
        elif self.last is not None and first <= self.last:
            problems.append(
                Problem("overlap", first, self.last, frame.turn,
                        "merged frame covers offsets already delivered")
            )  # fmt: skip
            if (t := self._turns.get(frame.turn)) is not None:
                t.whole = False
        self.last = frame.offset
        if frame.kind == "part" and (refused := self._refuse_part(frame)) is not None:
            problems.append(refused)  # its offset is consumed: a resume does not ask again
            return self._done(False, problems)
        self._track(frame, problems)
        return self._done(True, problems)

    def _refuse_part(self, frame: Frame) -> Problem | None:
        """A part frame that would corrupt its turn's parts, as a problem (such a frame
        is never delivered)."""
        try:
            ref = frame_part(frame.meta)
            if frame.turn in self._ended:
                raise PartError(f"{ref.part} {ref.id!r} after turn {frame.turn} ended")
            t = self._turns.get(frame.turn)
            if t is not None and t.whole:
                t.parts.apply(ref, frame.text, frame.offset)
        except PartError as exc:
            return Problem("part", frame.offset, frame.offset, frame.turn, str(exc))
        return None

    def _track(self, frame: Frame, problems: list[Problem]) -> None:
        if frame.kind == "meta":
            self._turns[frame.turn] = _Turn()
            self._ended.pop(frame.turn, None)
            while len(self._turns) > self.MAX_TURNS:
                self._turns.popitem(last=False)
            return
        if frame.kind in ("done", "error"):
            self._ended[frame.turn] = None
            while len(self._ended) > self.MAX_TURNS:
                self._ended.popitem(last=False)
        t = self._turns.get(frame.turn)
        if t is None:
            return  # joined mid-turn: its text cannot be checked
        if frame.kind == "token":
            t.text.append(frame.text)
            return
        if frame.kind not in ("done", "error"):
            return
        del self._turns[frame.turn]
        if frame.kind == "done" and t.whole:
            problem = check_done(frame, "".join(t.text), t.parts)
            if problem is not None:
                problems.append(problem)

    def _break_all(self) -> None:
        for t in self._turns.values():
            t.whole = False

    def _done(self, deliver: bool, problems: list[Problem]) -> tuple[bool, list[Problem]]:
        self.problems += len(problems)
        return deliver, problems


def check_done(frame: Frame, text: str, parts: Parts | None = None) -> Problem | None:
    """The done frame's ``chars`` / ``sha256`` against ``text`` and its ``parts`` /
    ``parts_sha256`` against ``parts`` (none: a turn without parts); None if they agree
    or are absent."""
    m = frame.meta or {}
    wrong: list[str] = []
    records = parts.records if parts is not None else []
    count = m.get("parts", 0)
    if isinstance(count, int) and not isinstance(count, bool) and count != len(records):
        wrong.append(f"parts {len(records)} != {count}")
    pdigest = m.get("parts_sha256")
    if isinstance(pdigest, str) and parts_digest(records) != pdigest.lower():
        wrong.append("parts_sha256 differs")
    chars = m.get("chars")
    if isinstance(chars, int) and not isinstance(chars, bool) and chars != len(text):
        wrong.append(f"chars {len(text)} != {chars}")  # a str's len counts code points
    digest = m.get("sha256")
    if isinstance(digest, str) and hashlib.sha256(text.encode()).hexdigest() != digest.lower():
        wrong.append("sha256 differs")
    if not wrong:
        return None
    return Problem("integrity", None, frame.offset, frame.turn, "; ".join(wrong))


def backoff_s(
    attempt: int, *, base_s: float = 0.25, max_s: float = 10.0, rand: random.Random | None = None
) -> float:
    """Delay before reconnect ``attempt`` (0-based): exponential, capped, equal jitter
    (half fixed, half random) so that a relay's clients do not return all at once."""
    ceiling = min(max_s, base_s * 2.0 ** min(attempt, 30))
    r = rand.random() if rand is not None else random.random()
    return ceiling / 2 + r * ceiling / 2
