"""The Vercel AI SDK's UI message stream, as a running turn's frames become it: pure.

The SDK's ``useChat`` reads a reply as Server-Sent Events whose ``data:`` are JSON parts
(``x-vercel-ai-ui-message-stream: v1``): ``start`` (``messageId`` = ``<sid>-<turn>``),
``text-start``, ``text-delta`` per token frame, ``text-end``, ``finish``
(``finishReason``; the done frame's meta as ``messageMetadata``), or ``error`` (+
``finish`` with ``finishReason: "error"``) for an error frame or frames lost for good;
then ``data: [DONE]``. Both ends that speak it use this module: the relay's resumable
stream (:mod:`relay.fronts.aisdk.conn`) and the worker's chat POST
(:mod:`worker.fronts.aisdk.http`).

Order of use::

    ui = UiTurn(sid, turn)
    for frame in frames: body += b"".join(encode_chunk(c) for c in ui.feed(frame))
    if ui.finished: body += DONE
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from relay.protocol import sse
from relay.protocol.frame import Frame

__all__ = ["DONE", "UI_HEADERS", "UiTurn", "encode_chunk"]

UI_HEADERS: Final = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
    "x-vercel-ai-ui-message-stream": "v1",
}
DONE: Final = sse.DONE
_FINISH_REASONS: Final = frozenset(("stop", "length", "content-filter", "tool-calls", "error"))
_encode = msgspec.json.Encoder()


def encode_chunk(chunk: dict[str, Any]) -> bytes:
    """One UI message chunk as an SSE event (``data: <json>`` + blank line)."""
    return sse.event(_encode.encode(chunk))


class UiTurn:
    """The frames of one turn -> UI message chunks. :meth:`feed` every frame of the
    session from before the turn's start; frames of other turns are ignored; once
    :attr:`finished`, the stream ends with :data:`DONE`."""

    def __init__(self, session: str, turn: int) -> None:
        self.session, self.turn = session, turn
        self.text_id = f"text-{turn}"
        self.started = self.text_open = self.finished = False

    def feed(self, frame: Frame) -> list[dict[str, Any]]:
        if self.finished:
            return []
        if frame.kind == "gap":
            if not self.started:
                return []  # lost frames before the turn began: not this reply's text
            return self.fail(f"frames {frame.text}: the reply is incomplete")
        if frame.turn != self.turn or frame.kind == "presence":
            return []
        out = self._start(frame)
        if frame.kind == "token":
            out += self._text_start()
            if frame.text:
                out.append({"type": "text-delta", "id": self.text_id, "delta": frame.text})
        elif frame.kind == "done":
            meta = frame.meta or {}
            out += self._text_start()
            out.append({"type": "text-end", "id": self.text_id})
            reason = meta.get("finish_reason") or "stop"
            out.append({
                "type": "finish",
                "finishReason": reason if reason in _FINISH_REASONS else "other",
                "messageMetadata": {"session": self.session, "turn": self.turn, **meta},
            })  # fmt: skip
            self.finished = True
        elif frame.kind == "error":
            out += self.fail(frame.text or "the turn failed")
        return out

    def _start(self, frame: Frame) -> list[dict[str, Any]]:
        if self.started:
            return []
        self.started = True
        meta = {"session": self.session, "turn": self.turn}
        if frame.kind == "meta" and frame.meta:
            meta.update({k: v for k, v in frame.meta.items() if k in ("engine", "preferred")})
        return [{"type": "start", "messageId": f"{self.session}-{self.turn}",
                 "messageMetadata": meta}]  # fmt: skip

    def _text_start(self) -> list[dict[str, Any]]:
        if self.text_open:
            return []
        self.text_open = True
        return [{"type": "text-start", "id": self.text_id}]

    def fail(self, text: str) -> list[dict[str, Any]]:
        """End the reply with an error part (and a finish whose reason is "error")."""
        self.finished = True
        out: list[dict[str, Any]] = []
        if self.text_open:
            out.append({"type": "text-end", "id": self.text_id})
        out.append({"type": "error", "errorText": text})
        out.append({"type": "finish", "finishReason": "error"})
        return out
