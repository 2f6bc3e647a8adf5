"""The Vercel AI SDK's UI message stream, as a running turn's frames become it: pure.

The SDK's ``useChat`` reads a reply as Server-Sent Events whose ``data:`` are JSON parts
(``x-vercel-ai-ui-message-stream: v1``): ``start`` (``messageId`` = ``<sid>-<turn>``),
``text-start``, ``text-delta`` per token frame, ``text-end``, ``finish``
(``finishReason``; the done frame's meta as ``messageMetadata``), or ``error`` (+
``finish`` with ``finishReason: "error"``) for an error frame or frames lost for good;
then ``data: [DONE]``. A reply's parts (docs/PROTOCOL.md, "Parts") become the SDK's own
chunks: ``reasoning-start`` / ``-delta`` / ``-end``, ``tool-input-start`` / ``-delta`` /
``-available`` (the call's arguments parsed), ``tool-output-available`` (or
``tool-output-error``), ``source-url``, ``data-<name>``; a ``usage`` part has none. Text
that a part interrupts ends (``text-end``) and goes on under a new id, so that the SDK's
message keeps text and parts in their order. Both ends that speak it use this module:
the relay's resumable stream (:mod:`relay.fronts.aisdk.conn`) and the worker's chat POST
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
from relay.protocol.parts import PartError, frame_part

__all__ = ["DONE", "UI_HEADERS", "UiTurn", "encode_chunk"]

UI_HEADERS: Final = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
    "x-vercel-ai-ui-message-stream": "v1",
}
DONE: Final = sse.DONE
_FINISH_REASONS: Final = frozenset(("stop", "length", "content-filter", "tool-calls", "error"))
_ALIASES: Final = {"tool_calls": "tool-calls", "content_filter": "content-filter"}
_encode = msgspec.json.Encoder()
_decode = msgspec.json.Decoder()


def _value(text: str) -> Any:
    try:
        return _decode.decode(text)
    except msgspec.DecodeError:
        return text


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
        self._texts = 1  # text runs so far: a part that interrupts the text ends one
        self._args: dict[str, list[str]] = {}  # a tool call's arguments so far
        self._names: dict[str, str] = {}

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
        if frame.kind == "part":
            out += self._part(frame)
        elif frame.kind == "token":
            out += self._text_start()
            if frame.text:
                out.append({"type": "text-delta", "id": self.text_id, "delta": frame.text})
        elif frame.kind == "done":
            meta = frame.meta or {}
            if self.text_open or self._texts == 1:  # a reply of parts only ends no text
                out += self._text_start()
                out.append({"type": "text-end", "id": self.text_id})
            reason = meta.get("finish_reason") or "stop"
            reason = _ALIASES.get(reason, reason)
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

    def _part(self, frame: Frame) -> list[dict[str, Any]]:
        try:
            ref = frame_part(frame.meta)
        except PartError:
            return []  # not a part this stream can show (a client's transcript refuses it)
        out: list[dict[str, Any]] = []
        if self.text_open:  # the text goes on after this part, under a new id
            out.append({"type": "text-end", "id": self.text_id})
            self.text_open = False
            self._texts += 1
            self.text_id = f"text-{self.turn}-{self._texts}"
        pid, text = ref.id, frame.text
        if ref.part == "reasoning":
            kind = {"start": "reasoning-start", "delta": "reasoning-delta", "end": "reasoning-end"}
            chunk: dict[str, Any] = {"type": kind[ref.phase or "delta"], "id": pid}
            if ref.phase == "delta":
                if not text:
                    return out
                chunk["delta"] = text
            out.append(chunk)
        elif ref.part == "tool-call":
            if ref.phase == "start":
                self._names[pid], self._args[pid] = ref.name, []
                out.append({"type": "tool-input-start", "toolCallId": pid, "toolName": ref.name})
            elif ref.phase == "delta" and text:
                self._args.setdefault(pid, []).append(text)
                out.append({"type": "tool-input-delta", "toolCallId": pid,
                            "inputTextDelta": text})  # fmt: skip
            elif ref.phase == "end":
                out.append({"type": "tool-input-available", "toolCallId": pid,
                            "toolName": self._names.get(pid, ""),
                            "input": _value("".join(self._args.pop(pid, [])))})  # fmt: skip
        elif ref.part == "tool-result":
            if ref.error:
                v = _value(text)
                out.append({"type": "tool-output-error", "toolCallId": pid,
                            "errorText": v if isinstance(v, str) else text})  # fmt: skip
            else:
                out.append({"type": "tool-output-available", "toolCallId": pid,
                            "output": _value(text)})  # fmt: skip
        elif ref.part == "source":
            v = _value(text)
            v = v if isinstance(v, dict) else {}
            src: dict[str, Any] = {"type": "source-url", "sourceId": pid, "url": v.get("url", "")}
            if isinstance(v.get("title"), str):
                src["title"] = v["title"]
            out.append(src)
        elif ref.part.startswith("data-"):
            out.append({"type": ref.part, "id": pid, "data": _value(text)})
        return out

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
