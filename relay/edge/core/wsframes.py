"""The client side of a WebSocket, read frame by frame (RFC 6455 section 5), as a pure
parser: bytes in, whole messages out. No sockets, no asyncio.

:class:`WsParser` is what :mod:`relay.edge.conn.ws` feeds with every chunk a client's
socket delivers. It reassembles fragmented messages and checks what RFC 6455 asks a
server to refuse, answering each refusal with the close code a client then gets (the
same codes aiohttp's reader gives, which the relay used before it read its WebSockets
itself):

- a frame without the client's mask (RFC 6455 5.1: a server must close the connection
  on one), RSV bits set (no extension is negotiated), a reserved opcode, a control frame that
  is fragmented or longer than 125 bytes, a continuation with no message started, a new
  data frame inside a fragmented one, a close frame of 1 byte or with a code no peer may
  send: ``1002`` (protocol error);
- a text message (or a close reason) that is not UTF-8: ``1007``;
- a message (all its fragments) longer than ``max_message`` bytes: ``1009``, as soon
  as a frame header says so (no payload of that size is ever buffered).

Order of use::

    p = WsParser(max_message=64 * 1024)
    for op, payload in p.feed(chunk):    # raises WsError(code, reason) on a refusal
        ...                              # op: TEXT (str), BINARY, PING, PONG (bytes),
                                         #     CLOSE ((code, reason))
"""

from __future__ import annotations

import struct
from typing import Final

__all__ = [
    "BINARY",
    "CLOSE",
    "PING",
    "PONG",
    "TEXT",
    "WsError",
    "WsParser",
    "close_frame",
    "pong_frame",
]

CONTINUATION: Final = 0x0
TEXT: Final = 0x1
BINARY: Final = 0x2
CLOSE: Final = 0x8
PING: Final = 0x9
PONG: Final = 0xA
_KNOWN: Final = frozenset((CONTINUATION, TEXT, BINARY, CLOSE, PING, PONG))

PROTOCOL_ERROR: Final = 1002
INVALID_DATA: Final = 1007
TOO_BIG: Final = 1009
NO_STATUS: Final = 1005  # a close frame with no code (never sent on the wire)
# close codes a peer may send (RFC 6455 7.4.1; 3000-4999 are for applications)
_SENDABLE: Final = frozenset((1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013))


class WsError(Exception):
    """The client broke the protocol: close the connection with ``code``."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code, self.reason = code, reason


def _unmask(data: bytes, mask: bytes) -> bytes:
    n = len(data)
    if n == 0:
        return data
    key = (mask * (n // 4 + 1))[:n]
    return (int.from_bytes(data, "big") ^ int.from_bytes(key, "big")).to_bytes(n, "big")


def _text(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise WsError(INVALID_DATA, f"{what} is not UTF-8") from None


class WsParser:
    """See the module docstring."""

    __slots__ = ("_buf", "_frag_op", "_frags", "_frags_len", "max_message")

    def __init__(self, max_message: int) -> None:
        self.max_message = max_message
        self._buf = b""
        self._frag_op = 0  # the opcode of the fragmented message being read (0: none)
        self._frags: list[bytes] = []
        self._frags_len = 0

    @property
    def idle(self) -> bool:
        """True when no frame or message is partly read (a new parser would do as well)."""
        return not self._buf and not self._frag_op

    def feed(self, data: bytes) -> list[tuple[int, object]]:
        """The messages ``data`` completes, in order; raise :class:`WsError` on the first
        refusal (what came before it is lost with the connection)."""
        buf = self._buf + data if self._buf else data
        out: list[tuple[int, object]] = []
        pos, end = 0, len(buf)
        while end - pos >= 2:
            b0, b1 = buf[pos], buf[pos + 1]
            fin, op = b0 & 0x80, b0 & 0x0F
            if b0 & 0x70:
                raise WsError(PROTOCOL_ERROR, "reserved bits set")
            if op not in _KNOWN:
                raise WsError(PROTOCOL_ERROR, f"reserved opcode {op}")
            n, head = b1 & 0x7F, 2
            if op >= CLOSE and (not fin or n > 125):
                raise WsError(PROTOCOL_ERROR, "control frame fragmented or over 125 bytes")
            if n == 126:
                if end - pos < 4:
                    break
                n, head = struct.unpack_from("!H", buf, pos + 2)[0], 4
            elif n == 127:
                if end - pos < 10:
                    break
                n, head = struct.unpack_from("!Q", buf, pos + 2)[0], 10
            if op < CLOSE and self._frags_len + n > self.max_message:
                raise WsError(TOO_BIG, "")
            if not b1 & 0x80:
                raise WsError(PROTOCOL_ERROR, "client frame not masked")
            head += 4
            if end - pos < head + n:
                break
            payload = _unmask(buf[pos + head : pos + head + n], buf[pos + head - 4 : pos + head])
            pos += head + n
            self._frame(fin, op, payload, out)
        self._buf = buf[pos:] if pos < end else b""
        return out

    def _frame(self, fin: int, op: int, payload: bytes, out: list[tuple[int, object]]) -> None:
        if op >= CLOSE:
            out.append((op, self._close(payload) if op == CLOSE else payload))
            return
        if op == CONTINUATION:
            if not self._frag_op:
                raise WsError(PROTOCOL_ERROR, "continuation with no message started")
        elif self._frag_op:
            raise WsError(PROTOCOL_ERROR, "new message inside a fragmented one")
        else:
            self._frag_op = op
        if not fin:
            self._frags.append(payload)
            self._frags_len += len(payload)
            return
        if self._frags:
            self._frags.append(payload)
            payload = b"".join(self._frags)
            self._frags, self._frags_len = [], 0
        op, self._frag_op = self._frag_op, 0
        out.append((op, _text(payload, "text message") if op == TEXT else payload))

    @staticmethod
    def _close(payload: bytes) -> tuple[int, str]:
        if not payload:
            return NO_STATUS, ""
        if len(payload) == 1:
            raise WsError(PROTOCOL_ERROR, "close frame of 1 byte")
        code = struct.unpack_from("!H", payload)[0]
        if (code < 3000 and code not in _SENDABLE) or code >= 5000:
            raise WsError(PROTOCOL_ERROR, f"close code {code}")
        return code, _text(payload[2:], "close reason")


def close_frame(code: int, reason: bytes = b"") -> bytes:
    """A server's close frame (unmasked, final): ``code`` and up to 123 bytes of reason."""
    body = struct.pack("!H", code) + reason[:123]
    return bytes((0x88, len(body))) + body


def pong_frame(payload: bytes) -> bytes:
    """A server's pong (unmasked, final) answering a ping's ``payload`` (<= 125 bytes)."""
    return bytes((0x8A, len(payload))) + payload
