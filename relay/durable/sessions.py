"""A chat session's frames read as a JSON-mode Durable Stream: one message per frame
(the frame's JSON as the backlog holds it), the stream offset ``n`` the position after
frame ``n`` (frame offsets are 1, 2, 3, ...; a ``gap`` frame stands at the last offset it
covers, so the position after it is that offset, not a count of messages), so a Durable
Streams client follows a chat live and resumes it where it left. The backlog's trimmed
start answers 410; a deleted session 404. Never closed: a session takes more turns. Live
reads wake on the session's own channel (the one the hub's screens read:
:class:`relay.durable.live.Waker` shares it).

Order of use: ``await reads.get(request, SessionSource(broker, sid), waker, options)``.
"""

from __future__ import annotations

from typing import Final

import msgspec

from relay.broker.base import Broker
from relay.broker.errors import SessionDeleted
from relay.durable.store import View
from relay.protocol.keys import live_channel

__all__ = ["SessionSource"]

PAGE_BYTES: Final = 1 << 20


class _At(msgspec.Struct):
    offset: int


_offset = msgspec.json.Decoder(_At)


class SessionSource:
    def __init__(self, broker: Broker, sid: str) -> None:
        self.broker, self.sid, self.channel = broker, sid, live_channel(sid)

    async def read(self, start: int | None, count: int) -> View | None:
        try:
            bounds = await self.broker.read_page(self.sid, None, 0, 0)
            low, last = bounds.first - 1, bounds.last
            at = last if start is None else start
            frames: list[bytes] = []
            if low <= at < last and count > 0:
                page = await self.broker.read_page(self.sid, at, count, PAGE_BYTES)
                low, last = page.first - 1, page.last
                frames = page.frames
        except SessionDeleted:
            return None
        return View(
            media_type="application/json", content_type="application/json", ttl=None,
            expires_at="", closed=False, next=last, gen=bounds.gen or "s", low=max(low, 0),
            start=at, messages=frames, positions=[_offset.decode(f).offset for f in frames],
        )  # fmt: skip
