"""One response of OpenAI's Responses API as its event stream, as one connection.

``GET /v1/responses/{id}?stream=true&starting_after=N``
(:func:`relay.edge.http.responses.responses_stream_handler`) replays the response's
turn from its first frame (the id names it: :mod:`relay.protocol.responses`) and goes
on live, writing the events numbered after ``N``, then ends the response once the
turn's terminal frame is written. Every relay writes the same events with the same
``sequence_number`` for the same frames, so a client whose relay died resumes on any
other with the last number it read.

What a :class:`ResponsesConn` adds to :class:`relay.edge.conn.base.Conn`: its encoding
(a :class:`relay.protocol.responses.ResponseTurn` per connection); no ``presence``
frame; a ``: heartbeat`` comment after ``heartbeat_s`` without a write (the SDK skips
comments); on a drain or a cutoff the response ends (the client resumes after its last
event); a deleted session ends it with ``response.failed``. A consumer that falls
behind past ``--queue-frames`` gets its queued token frames merged (one delta each
run: the text is the same, the merged runs' numbers are not sent).
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

from relay.edge.conn.base import Conn, Transport
from relay.edge.core.resume import Delivery
from relay.edge.fanout.hub import Hub
from relay.protocol import sse
from relay.protocol.codes import CloseCode
from relay.protocol.frame import FrameError, decode
from relay.protocol.responses import ResponseId, ResponseTurn, encode_event

__all__ = ["ResponsesConn"]

HEARTBEAT: Final = sse.comment("heartbeat")
_LAST_CHUNK: Final = b"0\r\n\r\n"


class ResponsesConn(Conn):
    """One response's event stream. See the module docstring."""

    transport_kind: ClassVar[Transport] = Transport.RESPONSES

    __slots__ = ("_rt",)

    def __init__(self, hub: Hub, rid: ResponseId, starting_after: int, **kw: Any) -> None:
        super().__init__(hub, rid.session, rid.first - 1, None, **kw)
        self._rt = ResponseTurn(rid, starting_after)

    def encode(self, d: Delivery) -> bytes:
        """The events of one frame (none for frames of other turns)."""
        try:
            frame = decode(d.data)
        except FrameError:
            return b""
        return b"".join([encode_event(e) for e in self._rt.feed(frame)])

    def _write(self, ds: list[Delivery]) -> None:
        super()._write(ds)
        if self._rt.finished and self.stop is None:
            self.stop = (CloseCode.CLOSED, "the response ended")
            t = self._transport
            if t is not None and self.chunked:
                t.write(_LAST_CHUNK)
            self.close_transport()

    def notice(self, d: Delivery) -> None:
        """A response is one turn: the presence count is not part of it."""

    def beat(self, now: float, heartbeat_s: float) -> None:
        if self.last_write <= now - heartbeat_s and self.idle_room():
            self.write_raw(HEARTBEAT)

    async def goodbye(self, code: CloseCode, reason: str) -> None:
        """Drained or cut: end the response (the client resumes after its last event).
        The session was deleted: ``response.failed``, then the end."""
        t = self._transport
        if code is CloseCode.SESSION_DELETED and not self._rt.finished:
            self.write_raw(b"".join([encode_event(e) for e in self._rt.fail(reason)]))
        if t is not None and self.chunked:
            t.write(_LAST_CHUNK)
