"""One response of OpenAI's Responses API as its event stream, as one connection.

``GET /v1/responses/{id}?stream=true&starting_after=N``
(:func:`relay.fronts.responses.http.responses_stream_handler`) replays the response's
turn from its first frame (the id names it: :mod:`relay.fronts.responses.wire`) and goes
on live, writing the events numbered after ``N``, then ends the response once the
turn's terminal frame is written. Every relay writes the same events with the same
``sequence_number`` for the same frames, so a client whose relay died resumes on any
other with the last number it read.

What a :class:`ResponsesConn` adds to :class:`relay.edge.conn.oneturn.OneTurnConn`
(no ``presence`` frame, heartbeat comments, which the SDK skips; the end on a drain or
a cutoff, the client resuming after its last event): its encoding (a
:class:`relay.fronts.responses.wire.ResponseTurn` per connection); a deleted session ends
it with ``response.failed``. A consumer that falls
behind past ``--queue-frames`` gets its queued token frames merged (one delta each
run: the text is the same, the merged runs' numbers are not sent).
"""

from __future__ import annotations

from typing import Any, ClassVar

from relay.edge.conn.oneturn import OneTurnConn
from relay.edge.fanout.hub import Hub
from relay.fronts.responses.wire import ResponseId, ResponseTurn, encode_event
from relay.protocol.frame import Frame

__all__ = ["ResponsesConn"]


class ResponsesConn(OneTurnConn):
    """One response's event stream. See the module docstring."""

    transport_kind: ClassVar[str] = "responses"  # one response's events
    end_reason: ClassVar[str] = "the response ended"

    __slots__ = ("_rt",)

    def __init__(self, hub: Hub, rid: ResponseId, starting_after: int, **kw: Any) -> None:
        super().__init__(hub, rid.session, rid.first - 1, None, **kw)
        self._rt = ResponseTurn(rid, starting_after)

    def translate(self, frame: Frame) -> bytes:
        """The events of one frame (none for frames of other turns)."""
        return b"".join([encode_event(e) for e in self._rt.feed(frame)])

    def failure(self, reason: str) -> bytes:
        """``response.failed``: the session was deleted."""
        return b"".join([encode_event(e) for e in self._rt.fail(reason)])

    @property
    def turn_finished(self) -> bool:
        return self._rt.finished
