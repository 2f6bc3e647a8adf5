"""Incremental Server-Sent Events decoder (pure, no I/O): the one SSE reader of the
project, used by the worker's engine client, the Python client (:mod:`relay.client`),
the benchmarks and the tests. :mod:`relay.protocol.sse` is the encoder.

Follows the WHATWG event-stream parsing rules: UTF-8 (a leading BOM is dropped), lines
end in CRLF, LF or CR (also when the CR and LF arrive in different chunks), ``field:
value`` with at most one space removed after the colon, a ``field`` line without colon
is a field with an empty value, lines starting with ``:`` are comments, several
``data`` lines are joined with LF, a blank line dispatches the event (none when no
``data`` line came), the event type resets after each dispatch while the last event id
persists (an ``id`` with NUL is ignored, an empty ``id`` resets it to ""), and ``retry``
takes ASCII digits only. One lenient
deviation: at end of stream a pending event is dispatched instead of dropped (some
servers omit the final blank line after ``data: [DONE]``).

Order of use: ``d = SSEDecoder(on_comment=...)``; ``d.feed(chunk)`` for every chunk of
bytes read, handling the returned events; ``d.close()`` at end of stream. Comments
(heartbeats, the relay's goodbye ``close <code> <reason>``) go to ``on_comment`` and are
counted in ``d.comments``; ``d.retry_ms`` is the last ``retry:`` hint (None before
one). ``SSEError`` is raised when a line or an event exceeds the size limits.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["SSEDecoder", "SSEError", "SSEEvent"]

_EOL = re.compile(r"\r\n|\r|\n")


class SSEError(ValueError):
    """The stream broke a size limit."""


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """A dispatched event: its data, type, the last event id and ``retry:`` hint seen."""

    data: str
    event: str = "message"
    id: str | None = None
    retry_ms: int | None = None


class SSEDecoder:
    """Turns chunks of bytes into ``SSEEvent`` values."""

    def __init__(
        self,
        *,
        max_line_chars: int = 1 << 20,
        max_event_chars: int = 4 << 20,
        on_comment: Callable[[str], None] | None = None,
    ) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._skip_lf = False
        self._started = False
        self._data: list[str] = []
        self._data_chars = 0
        self._event = ""
        self._last_id: str | None = None
        self._retry: int | None = None
        self._max_line = max_line_chars
        self._max_event = max_event_chars
        self._on_comment = on_comment
        self.comments = 0

    @property
    def retry_ms(self) -> int | None:
        """The last ``retry:`` hint (the reconnection time), None before one."""
        return self._retry

    @property
    def last_id(self) -> str | None:
        """The last event id (None before any ``id:`` line)."""
        return self._last_id

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        return self._text(self._utf8.decode(chunk))

    def close(self) -> list[SSEEvent]:
        events = self._text(self._utf8.decode(b"", final=True))
        if self._buf:
            self._line(self._buf, events)
            self._buf = ""
        if self._data:
            self._line("", events)
        return events

    def _text(self, text: str) -> list[SSEEvent]:
        if not self._started and text:
            self._started = True
            text = text.removeprefix("\ufeff")
        if self._skip_lf and text:
            if text[0] == "\n":
                text = text[1:]
            self._skip_lf = False
        if not text:
            return []
        buf = self._buf + text
        lines = _EOL.split(buf)
        self._buf = lines.pop()
        if len(self._buf) > self._max_line:
            raise SSEError(f"SSE line longer than {self._max_line} characters")
        if buf.endswith("\r"):
            self._skip_lf = True
        events: list[SSEEvent] = []
        for line in lines:
            self._line(line, events)
        return events

    def _line(self, line: str, events: list[SSEEvent]) -> None:
        if not line:
            if self._data:
                events.append(
                    SSEEvent(
                        "\n".join(self._data), self._event or "message", self._last_id, self._retry
                    )
                )
            self._data = []
            self._data_chars = 0
            self._event = ""
            return
        if line[0] == ":":
            self.comments += 1
            if self._on_comment is not None:
                self._on_comment(line[1:].removeprefix(" "))
            return
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data_chars += len(value) + 1
            if self._data_chars > self._max_event:
                raise SSEError(f"SSE event larger than {self._max_event} characters")
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            if "\x00" not in value:
                self._last_id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            self._retry = int(value)
