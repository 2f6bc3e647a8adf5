"""Server-Sent Events encoding (WHATWG HTML, "Server-sent events") and resume offsets.

Pure (standard library only): bytes in, bytes out; no sockets, no clock.

Encoding rules kept here:

- an event is ``id:``, ``event:``, one ``data:`` line per line of the payload (the
  payload is split on CRLF, CR and LF, as the parser joins ``data`` lines with LF), and a
  blank line that dispatches it; the stream is UTF-8, lines end with LF;
- ``id`` must not contain CR, LF or NUL (a NUL makes a browser ignore the id), ``event``
  not CR or LF; violations raise :class:`ValueError` (they are bugs, not client input);
- ``retry:`` is a decimal integer (ms); a block with only ``retry:`` / comments
  dispatches nothing, so hints and heartbeats never show up as events;
- comments (``: text``) are heartbeats and the goodbye line.

Resume offsets come from clients: ``Last-Event-ID`` (header, or ``last_event_id`` query
for clients that cannot set headers) on SSE, ``from`` on WebSocket. :func:`parse_offset`
accepts a decimal integer in ``0 ..`` :data:`MAX_OFFSET` and raises :class:`OffsetError`
(a 400 with its reason) for anything else.

Order of use per SSE response: :func:`preamble` (``retry:`` + hello event) once, then
:func:`event` per delivery and :func:`comment` per heartbeat, :func:`goodbye` last.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = [
    "DONE",
    "FRAME_EVENT",
    "MAX_OFFSET",
    "OffsetError",
    "comment",
    "event",
    "goodbye",
    "parse_offset",
    "preamble",
    "resume_offset",
    "retry",
]

MAX_OFFSET: Final = 2**53 - 1  # exact in JavaScript numbers and JSON everywhere
_MAX_OFFSET_DIGITS: Final = len(str(MAX_OFFSET))
_LINES: Final = re.compile(rb"\r\n|\r|\n")
_DIGITS: Final = re.compile(r"[0-9]+")
# an event with an integer id, a checked type and one line of data, in one format step:
# what event() writes for it, and what the edge's fast path (relay.edge.conn.base) fills
# in itself, with no call, for a frame it encodes once for all its sockets
FRAME_EVENT: Final = b"id: %d\nevent: %b\ndata: %b\n\n"
_KINDS: dict[str, bytes] = {}  # event types checked and encoded, by name
_MAX_KINDS: Final = 256


class OffsetError(ValueError):
    """A resume offset that is not a non-negative decimal integer in range."""


def _lines(payload: bytes) -> list[bytes]:
    return _LINES.split(payload)


def _kind(kind: str) -> bytes:
    """``kind`` checked (non-empty, no CR or LF) and encoded; kept once checked."""
    out = _KINDS.get(kind)
    if out is None:
        if not kind or "\r" in kind or "\n" in kind:
            raise ValueError("an SSE event type must be non-empty without CR or LF")
        out = kind.encode()
        if len(_KINDS) < _MAX_KINDS:  # the event types of a program: a few dozen
            _KINDS[kind] = out
    return out


def event(
    data: bytes, *, id: int | str | None = None, kind: str | None = None, space: bool = True
) -> bytes:
    """One dispatched event: ``id:``, ``event:`` and ``data:`` lines, then a blank line.

    The one SSE encoder: every front that writes SSE (the relay's own wire, the AI SDK's
    UI message stream, OpenAI's chat completions and Responses events, Durable Streams)
    makes its events here. ``space``: a space after ``data:`` (the fields' usual
    spelling; Durable Streams' wire has none, which a parser reads the same).
    """
    if type(id) is int and kind is not None and space and 10 not in data and 13 not in data:
        return FRAME_EVENT % (id, _KINDS.get(kind) or _kind(kind), data)  # one format step
    head = b""
    if id is not None:
        ident = str(id)
        if "\r" in ident or "\n" in ident or "\0" in ident:
            raise ValueError("an SSE id may not contain CR, LF or NUL")
        head = b"id: " + ident.encode() + b"\n"
    if kind is not None:
        head += b"event: " + _kind(kind) + b"\n"
    field = b"data: " if space else b"data:"
    if 10 not in data and 13 not in data:
        return head + field + data + b"\n\n"
    return head + b"".join([field + line + b"\n" for line in _lines(data)]) + b"\n"


DONE: Final = event(b"[DONE]")  # OpenAI's end of a stream (chat completions, the UI stream)


def retry(ms: int) -> bytes:
    """A ``retry:`` field on its own line (no blank line: it dispatches nothing)."""
    if ms < 0:
        raise ValueError("retry must be >= 0")
    return b"retry: %d\n" % ms


def comment(text: str = "") -> bytes:
    """A comment block (``: text`` lines + blank line): a heartbeat, invisible to clients."""
    body = b"".join(b": " + line + b"\n" for line in _lines(text.encode())) if text else b":\n"
    return body + b"\n"


def preamble(retry_ms: int, hello: bytes) -> bytes:
    """The first bytes of every SSE response: ``retry:`` and the ``hello`` event.

    The hello is an event (``event: hello``, ``data:`` = ``hello`` JSON) because an
    ``EventSource`` cannot read comments; it has no ``id:`` so the client's last event
    id (its resume point) stays the last frame's offset.
    """
    return retry(retry_ms) + event(hello, kind="hello")


def goodbye(code: str, reason: str, retry_ms: int | None = None) -> bytes:
    """The last bytes before the server closes: an optional ``retry:`` and a comment
    ``close <code> <reason>``. The browser reconnects by itself with ``Last-Event-ID``."""
    head = retry(retry_ms) if retry_ms is not None else b""
    return head + comment(f"close {code} {reason}")


def parse_offset(raw: str | None, *, name: str = "offset") -> int | None:
    """``None`` when absent or empty, else the offset as an int; :class:`OffsetError`
    whose message names ``name`` and says what is wrong."""
    if raw is None:
        return None
    text = raw.strip(" \t")
    if not text:
        return None
    if _DIGITS.fullmatch(text) is None:
        raise OffsetError(f"{name} must be a non-negative decimal integer")
    if len(text) > _MAX_OFFSET_DIGITS or int(text) > MAX_OFFSET:
        raise OffsetError(f"{name} must be at most {MAX_OFFSET}")
    return int(text)


def resume_offset(header: str | None, query: str | None) -> int | None:
    """The SSE resume point: the ``Last-Event-ID`` header, else the ``last_event_id``
    query; ``None`` (live from now) if neither is given."""
    if header is not None and header.strip(" \t"):
        return parse_offset(header, name="Last-Event-ID")
    return parse_offset(query, name="last_event_id")
