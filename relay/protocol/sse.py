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


class OffsetError(ValueError):
    """A resume offset that is not a non-negative decimal integer in range."""


def _lines(payload: bytes) -> list[bytes]:
    return _LINES.split(payload)


def event(data: bytes, *, id: int | str | None = None, kind: str | None = None) -> bytes:
    """One dispatched event: ``id:``, ``event:`` and ``data:`` lines, then a blank line."""
    out = bytearray()
    if id is not None:
        ident = str(id)
        if any(c in ident for c in "\r\n\0"):
            raise ValueError("an SSE id may not contain CR, LF or NUL")
        out += b"id: " + ident.encode()
        out += b"\n"
    if kind is not None:
        if not kind or "\r" in kind or "\n" in kind:
            raise ValueError("an SSE event type must be non-empty without CR or LF")
        out += b"event: " + kind.encode()
        out += b"\n"
    if b"\r" not in data and b"\n" not in data:
        out += b"data: " + data + b"\n"
    else:
        for line in _lines(data):
            out += b"data: " + line + b"\n"
    out += b"\n"
    return bytes(out)


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
