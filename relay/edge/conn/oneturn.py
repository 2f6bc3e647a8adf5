"""One turn of a session in another stream format, as one connection: what the AI SDK's
UI message stream (:mod:`relay.fronts.aisdk.conn`) and the Responses API's event stream
(:mod:`relay.fronts.responses.conn`) share.

A :class:`OneTurnConn` encodes each frame through its translator (one per connection:
the output depends on where in the turn it is; frames of other turns give nothing),
ends itself once the turn's terminal frame is written (after its format's last words,
:attr:`OneTurnConn.tail`), writes no ``presence`` frame (the stream is one reply, not the
session), a ``: heartbeat`` comment after ``heartbeat_s`` without a write, and on a
drain or a cutoff ends the response (the client resumes). When the session is deleted
before the turn ended, the translator's failure and the tail, then the end.
"""

from __future__ import annotations

from typing import ClassVar, Final

from relay.edge.conn.base import Conn
from relay.edge.core.resume import Delivery
from relay.protocol import sse
from relay.protocol.codes import CloseCode
from relay.protocol.frame import Frame, FrameError, decode

__all__ = ["OneTurnConn"]

HEARTBEAT: Final = sse.comment("heartbeat")
_LAST_CHUNK: Final = b"0\r\n\r\n"


class OneTurnConn(Conn):
    """One turn's frames translated; see the module docstring. A subclass says how."""

    tail: ClassVar[bytes] = b""  # written after the turn's last event (or its failure)
    end_reason: ClassVar[str] = "the turn ended"

    __slots__ = ()

    def translate(self, frame: Frame) -> bytes:
        """The encoded output of one frame."""
        raise NotImplementedError

    def failure(self, reason: str) -> bytes:
        """The encoded failure that ends an unfinished turn (its session was deleted)."""
        raise NotImplementedError

    @property
    def turn_finished(self) -> bool:
        """The turn's terminal frame was written."""
        raise NotImplementedError

    def encode(self, d: Delivery) -> bytes:
        try:
            frame = decode(d.data)
        except FrameError:
            return b""
        return self.translate(frame)

    def _end_response(self) -> None:
        t = self._transport
        if t is not None and self.chunked:
            t.write(_LAST_CHUNK)

    def _write(self, ds: list[Delivery]) -> None:
        super()._write(ds)
        if self.turn_finished and self.stop is None:
            self.stop = (CloseCode.CLOSED, self.end_reason)
            if self.tail:
                self.write_raw(self.tail)
            self._end_response()
            self.close_transport()

    def notice(self, d: Delivery) -> None:
        """One turn's reply: the presence count is not part of it."""

    def beat(self, now: float, heartbeat_s: float) -> None:
        if self.last_write <= now - heartbeat_s and self.idle_room():
            self.write_raw(HEARTBEAT)

    async def goodbye(self, code: CloseCode, reason: str) -> None:
        """Drained or cut: end the response (the client resumes). The session was
        deleted: the failure, the tail, then the end (there is nothing to resume)."""
        if code is CloseCode.SESSION_DELETED and not self.turn_finished:
            self.write_raw(self.failure(reason) + self.tail)
        self._end_response()
