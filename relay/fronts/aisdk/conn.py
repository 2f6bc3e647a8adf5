"""A running turn in the Vercel AI SDK's UI message stream, as one connection.

``GET /v1/sessions/{sid}/ui-stream`` (and its alias ``GET /v1/chat/{sid}/stream``, the
URL the SDK's ``DefaultChatTransport({api: "/v1/chat"})`` reconnects to;
:func:`relay.edge.http.handlers.ui_stream_handler`) answers ``204`` when no turn of the
session is generating (what ``useChat({resume: true})`` expects when there is nothing
to resume), and otherwise this stream: the running turn **from its first frame** (the
SDK's resume is a replay), each frame as the UI parts :mod:`relay.fronts.aisdk.wire`
makes of it, then ``data: [DONE]``, and the response ends.

What a :class:`UiConn` adds to :class:`relay.edge.conn.oneturn.OneTurnConn` (the parts
below that are the same for every one-turn stream): its encoding is its
own (a :class:`relay.fronts.aisdk.wire.UiTurn` per connection: the parts depend on
where in the turn it is); it ends itself once the turn's terminal frame is written;
a compacted join (``?compact=1``) gets the part of the reply already written as one
``text-delta`` (the replay's token frames merged, the open run too: the stream is that
turn), then the live frames one by one;
a ``: heartbeat`` comment after ``heartbeat_s`` without a write; no ``presence`` frame
(the stream is one reply, not the session); on a drain or a cutoff
it ends the response without ``[DONE]`` (the client resumes: a replay); when the
session is deleted, an ``error`` part, ``[DONE]`` and the end.

Any relay serves any session (the backlog and the live channel through the hub, like
the SSE and WebSocket streams), so many screens can resume the same turn. Same token,
refusals and drain as ``/events`` (docs/PROTOCOL.md).
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

from multidict import istr

from relay.edge.conn.oneturn import OneTurnConn
from relay.edge.fanout.hub import Hub
from relay.fronts.aisdk.wire import DONE, UiTurn, encode_chunk
from relay.fronts.aisdk.wire import UI_HEADERS as PROTOCOL_UI_HEADERS
from relay.protocol.frame import Frame

__all__ = ["UI_HEADERS", "UiConn"]

# istr names: see relay.edge.http.handlers.SSE_HEADERS
UI_HEADERS: Final = {istr(k): v for k, v in PROTOCOL_UI_HEADERS.items()}


class UiConn(OneTurnConn):
    """One UI message stream of one turn. See the module docstring."""

    transport_kind: ClassVar[str] = "ui"  # the AI SDK UI message stream
    compact_open: ClassVar[bool] = True  # the replay is the running turn: its text so far
    tail: ClassVar[bytes] = DONE

    __slots__ = ("_ui",)

    def __init__(self, hub: Hub, sid: str, turn: int, after: int, **kw: Any) -> None:
        super().__init__(hub, sid, after, None, **kw)
        self._ui = UiTurn(sid, turn)

    def translate(self, frame: Frame) -> bytes:
        """The UI parts of one frame (none for frames of other turns)."""
        return b"".join([encode_chunk(c) for c in self._ui.feed(frame)])

    def failure(self, reason: str) -> bytes:
        """An error part (and the finish it implies): the session was deleted."""
        return b"".join([encode_chunk(c) for c in self._ui.fail(reason)])

    @property
    def turn_finished(self) -> bool:
        return self._ui.finished
