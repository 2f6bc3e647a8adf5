"""Where each request on an HTTP/1.1 connection starts and ends, read from the bytes a
client sends, as a pure tracker: bytes in, a state out. No sockets, no clock.

:class:`Framing` is what :mod:`relay.service.httpguard` feeds with every chunk of a
connection before aiohttp parses it, so that it can hold each part of a request to its
own deadline. It knows only what the deadlines need: where a request head ends (the
first empty line; empty lines before a request line are skipped, RFC 9112 2.2), how
long its body is (``Content-Length``, or ``Transfer-Encoding: chunked`` read chunk by
chunk up to the last chunk and its trailers), and whether the head asks for an upgrade
(after which the bytes are not HTTP). It never decides what a request means: aiohttp's
parser does, and refuses what is malformed (a head whose framing cannot be read here,
two lengths, an unknown coding, is left to that refusal: its "body" has no end here,
so its deadline ends the connection if aiohttp has not).

States (:attr:`Framing.state`):

- ``IDLE``: between requests, no byte of the next head yet;
- ``HEAD``: part of a head has arrived;
- ``BODY``: a head declared a body that has not all arrived;
- ``OPAQUE``: a head asked for an upgrade; nothing more is read until its response
  ends (:meth:`Framing.response_done`; a declined upgrade goes on as HTTP).

:attr:`Framing.inflight` counts requests whose head has arrived and whose response has
not ended (the caller says when one ends). :meth:`Framing.deadline` names the deadline
that applies now: the head's, the body's, the idle connection's, or none while a
request is being answered.

Order of use::

    f = Framing()
    f.feed(chunk)            # every chunk the client sends, in order
    f.response_done()        # each time a response has been written to the end
    f.deadline()             # HEAD / BODY / IDLE / None: which timer should run
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = ["MAX_HEAD_BYTES", "Deadline", "Framing", "State"]

# A head longer than this is not buffered further (aiohttp refuses lines over 8190
# bytes): only its end is looked for, and its framing is taken as unreadable.
MAX_HEAD_BYTES: Final = 64 * 1024
_MAX_CHUNK_LINE: Final = 4096  # a chunk-size line (size and extensions) longer: unreadable
_CRLF: Final = b"\r\n"
_HEX: Final = b"0123456789abcdefABCDEF"


class State(enum.Enum):
    IDLE = "idle"
    HEAD = "head"
    BODY = "body"
    OPAQUE = "opaque"


class Deadline(enum.Enum):
    HEAD = "head"  # the head must be complete by then
    BODY = "body"  # the body must be complete by then
    IDLE = "idle"  # the next request must start by then


class _Body(enum.Enum):
    LENGTH = 0  # so many bytes left
    CHUNK_SIZE = 1  # reading a chunk-size line
    CHUNK_DATA = 2  # so many bytes of a chunk left, then its CRLF
    CHUNK_END = 3  # the CRLF after a chunk's data
    TRAILERS = 4  # after the last chunk: trailer lines up to an empty one
    UNKNOWN = 5  # no readable framing: never ends here


def _head_end(buf: bytes | bytearray, start: int = 0) -> int:
    """The index just past the head's empty line in ``buf`` (``\\n\\r\\n`` or
    ``\\n\\n``), or -1."""
    a = buf.find(b"\n\r\n", start)
    b = buf.find(b"\n\n", start)
    if a < 0:
        return b + 2 if b >= 0 else -1
    if b < 0 or a < b:
        return a + 3
    return b + 2


def _framing(head: bytes) -> tuple[_Body | None, int, bool]:
    """(how the body is framed (None: no body), its length, upgrade) from a head."""
    lines = head.split(b"\n")
    method = lines[0].split(b" ", 1)[0].strip().upper()
    length: int | None = None
    chunked = unknown = upgrade = False
    conn_upgrade = False
    for raw in lines[1:]:
        name, sep, value = raw.partition(b":")
        if not sep:
            continue
        key = name.strip().lower()
        val = value.strip()
        if key == b"content-length":
            if length is not None or not val.isdigit():
                unknown = True
            else:
                length = int(val)
        elif key == b"transfer-encoding":
            codings = [c.strip().lower() for c in val.split(b",")]
            if chunked or codings[-1] != b"chunked":
                unknown = True
            chunked = True
        elif key == b"upgrade" and val:
            upgrade = True
        elif key == b"connection":
            conn_upgrade |= b"upgrade" in [t.strip().lower() for t in val.split(b",")]
    if method == b"CONNECT" or (upgrade and conn_upgrade):
        return None, 0, True
    if unknown or (chunked and length is not None):
        return _Body.UNKNOWN, 0, False
    if chunked:
        return _Body.CHUNK_SIZE, 0, False
    if length:
        return _Body.LENGTH, length, False
    return None, 0, False


class Framing:
    """See the module docstring."""

    __slots__ = ("_body", "_buf", "_left", "_long", "heads", "inflight", "state")

    def __init__(self) -> None:
        self.state = State.IDLE
        self.inflight = 0  # heads arrived whose response has not ended
        self.heads = 0  # heads arrived on this connection
        self._buf = bytearray()  # the head so far, or a chunk-size / trailer line so far
        self._body = _Body.UNKNOWN
        self._left = 0  # bytes of the body (LENGTH) or of the chunk (CHUNK_DATA) left
        self._long = False  # the head so far is over MAX_HEAD_BYTES: only its end is looked for

    def deadline(self) -> Deadline | None:
        """The deadline that applies now: the head's while one is arriving (and, on a
        connection that has not sent one yet, from its opening), the body's, the idle
        connection's when no request is being answered, else none."""
        if self.state is State.HEAD:
            return Deadline.HEAD
        if self.state is State.BODY:
            return Deadline.BODY
        if self.state is State.OPAQUE or self.inflight:
            return None
        return Deadline.HEAD if self.heads == 0 else Deadline.IDLE

    def response_done(self) -> None:
        """A response was written to its end."""
        if self.inflight:
            self.inflight -= 1
        if self.state is State.OPAQUE and not self.inflight:  # a declined upgrade
            self.state = State.IDLE
            self._buf.clear()

    def feed(self, data: bytes) -> None:
        """Read ``data``, the next bytes of the connection."""
        pos, end = 0, len(data)
        while pos < end:
            state = self.state
            if state is State.OPAQUE:
                return
            if state is State.IDLE:
                while pos < end and data[pos] in _CRLF:  # empty lines before a request
                    pos += 1
                if pos == end:
                    return
                self.state = State.HEAD
            elif state is State.HEAD:
                pos = self._read_head(data, pos)
            else:
                pos = self._read_body(data, pos)

    def _read_head(self, data: bytes, pos: int) -> int:
        buf = self._buf
        if not buf:  # the usual case: the whole head in this chunk, no copy kept
            stop = _head_end(data, pos)
            if stop >= 0:
                self._head_done(data[pos:stop], readable=not self._long)
                self._long = False
                return stop
        start = max(len(buf) - 2, 0)  # the empty line may straddle the chunks
        buf += data[pos:]
        stop = _head_end(buf, start)
        if stop < 0:
            if len(buf) > MAX_HEAD_BYTES:  # too long to read: keep a tail to find its end
                del buf[:-2]
                self._long = True
            return len(data)
        consumed = stop - (len(buf) - (len(data) - pos))  # the bytes of data in the head
        head = bytes(buf[:stop])
        buf.clear()
        self._head_done(head, readable=not self._long)
        self._long = False
        return pos + consumed

    def _head_done(self, head: bytes, *, readable: bool) -> None:
        self.heads += 1
        self.inflight += 1
        body, length, upgrade = _framing(head) if readable else (_Body.UNKNOWN, 0, False)
        if upgrade:
            self.state = State.OPAQUE
        elif body is None:
            self.state = State.IDLE
        else:
            self.state, self._body, self._left = State.BODY, body, length

    def _read_body(self, data: bytes, pos: int) -> int:
        body, end = self._body, len(data)
        if body is _Body.UNKNOWN:
            return end
        if body is _Body.LENGTH or body is _Body.CHUNK_DATA:
            take = min(self._left, end - pos)
            self._left -= take
            if not self._left:
                if body is _Body.LENGTH:
                    self.state = State.IDLE
                else:
                    self._body = _Body.CHUNK_END
            return pos + take
        # a line: the chunk size, the CRLF after a chunk, or a trailer
        nl = data.find(b"\n", pos)
        if nl < 0:
            self._buf += data[pos:]
            if len(self._buf) > _MAX_CHUNK_LINE:
                self._body = _Body.UNKNOWN
            return end
        line = bytes(self._buf) + data[pos:nl] if self._buf else data[pos:nl]
        self._buf.clear()
        line = line.rstrip(b"\r")
        if body is _Body.CHUNK_END:
            self._body = _Body.CHUNK_SIZE if not line else _Body.UNKNOWN
        elif body is _Body.TRAILERS:
            if not line:
                self.state = State.IDLE
        else:
            size = line.split(b";", 1)[0].strip()
            n = int(size, 16) if size and size.strip(_HEX) == b"" else -1
            if n < 0:
                self._body = _Body.UNKNOWN
            elif n == 0:
                self._body = _Body.TRAILERS
            else:
                self._body, self._left = _Body.CHUNK_DATA, n
        return nl + 1
