"""The wire frame: one typed struct, one encoding (JSON), versioned.

A frame is encoded once by the producer; the same bytes are appended to the session's
backlog stream, SPUBLISHed, and written to every socket that watches the session (SSE
``data:`` line or WebSocket text message). The relay decodes a frame only to read its
``offset`` and ``kind``; it re-encodes only when it merges token frames for a slow
client (:func:`merge_tokens`).

Order of use: producer builds :class:`Frame` values and calls :func:`encode`; consumers
call :func:`decode` on bytes from Redis and get a :class:`Frame` or :class:`FrameError`.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Sequence
from typing import Any, Final, Literal

import msgspec

__all__ = [
    "GEN_MAX_LEN",
    "KINDS",
    "MAX_FRAME_BYTES",
    "MAX_INT",
    "VERSION",
    "Frame",
    "FrameError",
    "GenError",
    "Kind",
    "decode",
    "deleted_frame",
    "encode",
    "first_offset",
    "frame_gen",
    "gap_frame",
    "merge_key",
    "merge_tokens",
    "monotonic_ms",
    "now_ms",
    "parse_gen",
    "reset_frame",
]

VERSION: Final = 1
MAX_FRAME_BYTES: Final = 256 * 1024
MAX_INT: Final = (
    2**53 - 1
)  # offsets and turns: exact in JSON everywhere, = relay.protocol.sse.MAX_OFFSET

Kind = Literal["token", "part", "done", "error", "presence", "gap", "meta", "reset"]
KINDS: Final[frozenset[str]] = frozenset(
    ("token", "part", "done", "error", "presence", "gap", "meta", "reset")
)


class Frame(msgspec.Struct, frozen=True, kw_only=True):
    """One event of a session's stream.

    ``offset`` is the per-session position (1, 2, 3, ... across all turns); it is the
    SSE ``id:`` and the WebSocket resume point. ``turn`` numbers the chat turn that
    produced the frame, ``epoch`` the generation that wrote it (fencing). ``text`` is a
    token delta for ``token`` frames (the reply is the concatenation), a part's delta or
    value for ``part`` frames (:mod:`relay.protocol.parts`), a reason for ``error``
    frames. ``meta`` carries kind-specific details (engine, cache hit, TTFT,
    the user's message on ``meta`` frames, the missing range on ``gap`` frames).
    """

    v: int = VERSION
    session: str
    turn: int
    offset: int
    kind: Kind
    text: str = ""
    epoch: int = 0
    ts: int = 0
    meta: dict[str, Any] | None = None


class FrameError(ValueError):
    """Bytes that are not a valid frame of a version this code understands."""


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Frame)


def now_ms() -> int:
    """Wall-clock milliseconds: for times that cross processes (a frame's ``ts``)."""
    return time.time_ns() // 1_000_000


def monotonic_ms() -> int:
    """Monotonic milliseconds (> 0): for durations inside one process, which a wall-clock
    step (NTP) must not bend."""
    return time.monotonic_ns() // 1_000_000 + 1


def encode(frame: Frame) -> bytes:
    return _encoder.encode(frame)


def decode(data: bytes | bytearray | memoryview | str) -> Frame:
    """Decode one frame; raise :class:`FrameError` with a reason on anything else."""
    if len(data) > MAX_FRAME_BYTES:
        raise FrameError(f"frame larger than {MAX_FRAME_BYTES} bytes")
    try:
        frame = _decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise FrameError(f"invalid frame: {exc}") from None
    except msgspec.DecodeError as exc:
        raise FrameError(f"malformed frame: {exc}") from None
    except UnicodeError:  # bytes that are not UTF-8 inside a string; a str with lone
        # surrogates: msgspec lets both escape as UnicodeDecodeError / UnicodeEncodeError
        raise FrameError("malformed frame: text is not valid UTF-8") from None
    if frame.v != VERSION:
        raise FrameError(f"unsupported frame version {frame.v}")
    if not (0 <= frame.offset <= MAX_INT and 0 <= frame.turn <= MAX_INT):
        raise FrameError(f"offset or turn outside 0..{MAX_INT}")
    return frame


def gap_frame(session: str, first_missing: int, first_available: int, gen: str = "") -> Frame:
    """The explicit frame a client gets when frames it asked for are gone for good.

    ``offset`` is ``first_available - 1`` so that resuming from the gap's id continues
    at the first frame that still exists. ``gen``: the generation of the backlog the
    range was missing from (``meta.gen``, as in every other frame of that generation).
    """
    meta: dict[str, Any] = {"from": first_missing, "to": first_available - 1}
    if gen:
        meta["gen"] = gen
    return Frame(
        session=session,
        turn=0,
        offset=max(first_available - 1, 0),
        kind="gap",
        text=f"frames {first_missing}..{first_available - 1} are no longer in the backlog",
        ts=now_ms(),
        meta=meta,
    )


def frame_gen(frame: Frame) -> str:
    """The session generation a frame belongs to (``meta.gen``; "" when it has none)."""
    gen = frame.meta.get("gen") if frame.meta else None
    return gen if isinstance(gen, str) else ""


GEN_MAX_LEN: Final = 64
_GEN_RE: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")


class GenError(ValueError):
    """A generation id from a client that is not ``[A-Za-z0-9_-]{1,64}``; says why."""


def parse_gen(raw: str | None, *, name: str = "gen") -> str | None:
    """A generation id a client sends (the ``gen`` query parameter of the streams):
    ``None`` when absent or empty, else the id; :class:`GenError` naming ``name`` for
    anything longer than :data:`GEN_MAX_LEN` or outside ``A-Z a-z 0-9 _ -``."""
    if raw is None or raw == "":
        return None
    if len(raw) > GEN_MAX_LEN:
        raise GenError(f"{name} longer than {GEN_MAX_LEN} characters")
    if _GEN_RE.fullmatch(raw) is None:
        raise GenError(f"{name} may contain only A-Z a-z 0-9 _ -")
    return raw


def reset_frame(session: str, gen: str, previous: str) -> Frame:
    """The explicit frame a client gets when the session's keys expired and restarted
    (a new generation ``gen``): offsets start again at 1, so the client forgets its
    resume point (the frame's offset is 0) and takes what follows as a new stream."""
    return Frame(
        session=session,
        turn=0,
        offset=0,
        kind="reset",
        text="the session restarted (its keys expired): offsets start again at 1",
        ts=now_ms(),
        meta={"gen": gen, "previous_gen": previous, "code": "session_reset"},
    )


def deleted_frame(session: str) -> Frame:
    """What the producer that deleted a session SPUBLISHes on its live channel (never
    written to a backlog: the backlog is gone): a ``reset`` with ``code``
    ``session_deleted``, offset 0. A relay closes the session's streams on it."""
    return Frame(
        session=session,
        turn=0,
        offset=0,
        kind="reset",
        text="the session was deleted",
        ts=now_ms(),
        meta={"code": "session_deleted"},
    )


def merge_key(frame: Frame) -> tuple[str, ...] | None:
    """What a frame merges with: ``("token",)`` for text, ``("part", type, id)`` for a
    part's ``delta`` (only deltas of one part merge: a part's text appends like the
    reply's), ``None`` for every other frame."""
    if frame.kind == "token":
        return ("token",)
    if frame.kind == "part" and frame.meta and frame.meta.get("phase") == "delta":
        part, pid = frame.meta.get("part"), frame.meta.get("id")
        if isinstance(part, str) and isinstance(pid, str):
            return ("part", part, pid)
    return None


def first_offset(frame: Frame) -> int:
    """The first offset a frame covers: its own, or for a merged frame (text or a part's
    deltas) the first of the frames it replaced (``meta["from"]``)."""
    if frame.meta and "merged" in frame.meta and frame.kind in ("token", "part"):
        return int(frame.meta.get("from", frame.offset))
    return frame.offset


def merge_tokens(frames: Sequence[Frame]) -> Frame:
    """Merge consecutive frames of one turn that share a :func:`merge_key` into one (the
    reply's text, or one part's deltas: text only appends).

    Frames that are themselves merges merge again: the result's ``meta`` is the last
    frame's part fields (a part's delta) and ``{"merged": frames covered, "from": first
    offset covered}`` (and the frames' ``gen``), cumulative. It carries the offset of the
    last frame, so a client that resumes from it continues right after everything it
    received.
    """
    if not frames:
        raise ValueError("nothing to merge")
    first, last = frames[0], frames[-1]
    key = merge_key(first)
    if key is None or any(merge_key(f) != key for f in frames):
        raise ValueError("only token frames, or one part's delta frames, merge")
    for prev, cur in itertools.pairwise(frames):
        if cur.turn != first.turn or first_offset(cur) != prev.offset + 1:
            raise ValueError("only consecutive frames of one turn merge")
    start = first_offset(first)
    meta: dict[str, Any] = {}
    if key[0] == "part" and last.meta:
        meta = {k: v for k, v in last.meta.items() if k not in ("merged", "from", "gen", "n")}
    meta["merged"] = last.offset - start + 1
    meta["from"] = start
    if gen := frame_gen(last):
        meta["gen"] = gen
    return msgspec.structs.replace(last, text="".join(f.text for f in frames), meta=meta)
