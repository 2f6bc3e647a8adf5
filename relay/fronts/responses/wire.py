"""OpenAI's Responses API, as a turn's frames become it: pure.

A *response* is one turn of a session. Its id names the session, the turn and the
turn's first offset (``resp_<session>_<turn>_<first offset>``: a session id may hold
``_``, the last two fields are digits), so any relay or worker finds its frames with the
id alone, no lookup. The output message's id is ``msg_<session>_<turn>``; the
conversation is the session (``conv_<session>``).

Events and their ``sequence_number`` come from the frames' offsets, so every pod that
reads the same backlog writes the same events with the same numbers, and a stream
resumed with ``starting_after=N`` anywhere continues with event ``N + 1``. For a turn
whose first frame (its ``meta`` frame) is at offset ``F`` and a frame at offset ``o``,
``i = o - F``:

- ``meta`` (``i = 0``): ``response.created`` 0, ``response.in_progress`` 1,
  ``response.output_item.added`` 2, ``response.content_part.added`` 3;
- ``token`` (``i >= 1``): ``response.output_text.delta`` ``i + 3``;
- ``done`` (``i = n``): ``response.output_text.done`` ``n + 3``,
  ``response.content_part.done`` ``n + 4``, ``response.output_item.done`` ``n + 5``,
  then ``response.completed`` (finish ``stop``), ``response.incomplete`` (``length``:
  ``max_output_tokens``) or, for a stopped turn (``cancelled``), ``response.incomplete``
  with the response's ``status`` ``cancelled``, at ``n + 6``;
- ``error`` (``i = n``), or frames lost for good (a ``gap``): ``response.failed`` at
  ``n + 3``.

A reply's parts (docs/PROTOCOL.md, "Parts") are output items after the message (output
index 1, 2, ... in the order they started): a tool call is a ``function_call`` item
(``fc_<call id>``; ``response.output_item.added`` at its ``start``,
``response.function_call_arguments.delta`` per delta, ``.done`` and
``response.output_item.done`` at its ``end``), a reasoning part a ``reasoning`` item
(``rs_<id>``; its one part opened by ``response.content_part.added`` at its first delta,
``response.reasoning_text.delta`` per delta, ``.done`` and ``response.content_part.done``
before its item's done; for a summary the same with ``reasoning_summary_part`` and
``reasoning_summary_text``, as OpenAI streams them and its SDKs' accumulators demand);
a source is a ``url_citation`` annotation of the text
(``response.output_text.annotation.added``). A part frame's events are numbered after
the frame's own number (``i + 3``, the next ones ``+1`` each), and every later number
moves up by the events added so far: the numbering stays a function of the backlog.
Tool results, usage and data parts have no event in this API.

The request's parameters (model, instructions, metadata, ...) travel in the ``meta``
frame's ``response`` field (written by the worker), so the response object is the same
from any pod too; ``created_at`` is the meta frame's ``ts``.

Order of use::

    rt = ResponseTurn(parse_response_id(rid), starting_after=n)  # n = -1: everything
    for frame in frames_from(rt.first - 1): body += b"".join(map(encode_event, rt.feed(frame)))
    rt.finished, rt.response()  # the object as it stands
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from relay.protocol import sse
from relay.protocol.frame import Frame
from relay.protocol.keys import (
    OWNER_FIELD,
    InvalidSessionId,
    owner_key,
    parse_session,
)
from relay.protocol.parts import PartError, frame_part

__all__ = [
    "CANCELLED",
    "OWNER",
    "OWNER_FIELD",
    "SSE_HEADERS",
    "InvalidResponseId",
    "ResponseId",
    "ResponseTurn",
    "conversation_id",
    "encode_event",
    "owner_key",
    "parse_conversation_id",
    "parse_response_id",
    "response_object",
    "usage",
]

SSE_HEADERS: Final = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
OWNER: Final = "responses"  # the state hash's OWNER_FIELD (relay.protocol.keys) of its sessions
CANCELLED: Final = "cancelled"  # the done frame's finish reason of a stopped turn
_HEAD: Final = 4  # events of the meta frame
_encode = msgspec.json.Encoder()


# a reasoning item's text: its field -> (the text's events, the index's name, the part type)
_REASONING: Final = {
    "content": ("reasoning_text", "content_index", "reasoning_text"),
    "summary": ("reasoning_summary_text", "summary_index", "summary_text"),
}


def _reasoning_field(item: dict[str, Any]) -> str:
    """Where a reasoning item's text goes: its ``content``, or its ``summary``."""
    return "content" if "content" in item else "summary"


class InvalidResponseId(ValueError):
    """Not a response id of this service (a reason for the 404)."""


@dataclass(frozen=True, slots=True)
class ResponseId:
    session: str
    turn: int
    first: int  # the offset of the turn's meta frame

    def __str__(self) -> str:
        return f"resp_{self.session}_{self.turn}_{self.first}"

    @property
    def message_id(self) -> str:
        return f"msg_{self.session}_{self.turn}"


def parse_response_id(raw: str) -> ResponseId:
    head, _, rest = raw.partition("_")
    parts = rest.rsplit("_", 2)
    if head != "resp" or len(parts) != 3 or not all(p.isdigit() for p in parts[1:]):
        raise InvalidResponseId(f"no response with id {raw[:80]!r}")
    try:
        sid = parse_session(parts[0])
    except InvalidSessionId:
        raise InvalidResponseId(f"no response with id {raw[:80]!r}") from None
    turn, first = int(parts[1]), int(parts[2])
    if not 1 <= turn <= 2**53 - 1 or not 1 <= first <= 2**53 - 1:
        raise InvalidResponseId(f"no response with id {raw[:80]!r}")
    return ResponseId(sid, turn, first)


def conversation_id(sid: str) -> str:
    return f"conv_{sid}"


def parse_conversation_id(raw: str) -> str:
    """The session of ``conv_<session>``; :class:`InvalidResponseId` otherwise."""
    if not raw.startswith("conv_"):
        raise InvalidResponseId(f"no conversation with id {raw[:80]!r}")
    try:
        return parse_session(raw[5:])
    except InvalidSessionId:
        raise InvalidResponseId(f"no conversation with id {raw[:80]!r}") from None


def _json(text: str) -> Any:
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return None


def encode_event(event: dict[str, Any]) -> bytes:
    """One event as Server-Sent Events (``event:`` its type, ``data:`` the JSON)."""
    kind: str = event["type"]
    return sse.event(_encode.encode(event), kind=kind)


def usage(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The Responses ``usage`` of a done frame's meta (prompt, cached, reply tokens)."""

    def num(name: str) -> int:
        v = meta.get(name)
        return v if isinstance(v, int) and v >= 0 else 0

    prompt, out = num("prompt_tokens"), num("tokens")
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": num("cached_tokens"), "cache_write_tokens": 0},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + out,
    }


def _status_of(finish: str | None) -> tuple[str, str | None]:
    """(response status, incomplete reason) of a finish reason."""
    if finish == "length":
        return "incomplete", "max_output_tokens"
    if finish == CANCELLED:
        return "cancelled", None
    return "completed", None


def response_object(
    rid: ResponseId,
    *,
    status: str,
    text: str | None,
    params: Mapping[str, Any],
    created_at: int,
    usage_: dict[str, Any] | None = None,
    incomplete: str | None = None,
    error: str | None = None,
    items: list[dict[str, Any]] | None = None,
    annotations: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The Response object. ``text`` None: no output item yet; ``params``: the request's
    (the meta frame's ``response``); ``items``: the output items after the message
    (function calls, reasoning); ``annotations``: the text's citations."""
    output: list[dict[str, Any]] = []
    if text is not None:
        item_status = {"completed": "completed", "in_progress": "in_progress"}.get(
            status, "incomplete"
        )
        output.append({
            "id": rid.message_id, "type": "message", "role": "assistant",
            "status": item_status,
            "content": [{"type": "output_text", "text": text,
                         "annotations": list(annotations or []), "logprobs": []}],
        })  # fmt: skip
        output += [dict(x) for x in items or []]
    return {
        "id": str(rid),
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": bool(params.get("background")),
        "error": None if error is None else {"code": "server_error", "message": error},
        "incomplete_details": None if incomplete is None else {"reason": incomplete},
        "instructions": params.get("instructions"),
        "max_output_tokens": params.get("max_output_tokens"),
        "metadata": dict(params.get("metadata") or {}),
        "model": str(params.get("model") or ""),
        "output": output,
        "parallel_tool_calls": bool(params.get("parallel_tool_calls", False)),
        "previous_response_id": params.get("previous_response_id"),
        "conversation": {"id": conversation_id(rid.session)},
        "temperature": params.get("temperature"),
        "text": {"format": {"type": "text"}},
        "tool_choice": params.get("tool_choice") or "auto",
        "tools": list(params.get("tools") or []),
        "top_p": params.get("top_p"),
        "truncation": "disabled",
        "usage": usage_,
    }


class ResponseTurn:
    """The frames of one turn -> Responses events. :meth:`feed` the session's frames from
    the turn's first offset on (any other turn's frames are ignored); events numbered up
    to ``starting_after`` are left out (a resume). See the module docstring."""

    def __init__(self, rid: ResponseId, starting_after: int = -1) -> None:
        self.rid = rid
        self.after = starting_after
        self.params: dict[str, Any] = {}
        self.created_at = 0
        self.text: list[str] = []
        self.started = self.finished = False
        self.status = "in_progress"
        self.incomplete: str | None = None
        self.error: str | None = None
        self.error_code: str | None = None  # the error frame's meta.code (engine_down, ...)
        self.message: str | None = None  # the user's message (the meta frame's)
        self.usage: dict[str, Any] | None = None
        self.last = 0  # the index of the newest frame of the turn read (see the docstring)
        self.shift = 0  # events the parts added beyond one a frame (see the docstring)
        self.items: list[dict[str, Any]] = []  # output items after the message
        self._at: dict[tuple[str, str], int] = {}  # a part -> its place in items
        self.annotations: list[dict[str, Any]] = []

    @property
    def first(self) -> int:
        return self.rid.first

    def response(self) -> dict[str, Any]:
        """The response object as it stands (every event that carries one uses it)."""
        return response_object(
            self.rid, status=self.status, params=self.params, created_at=self.created_at,
            text="".join(self.text) if self.started else None, usage_=self.usage,
            incomplete=self.incomplete, error=self.error, items=self.items,
            annotations=self.annotations,
        )  # fmt: skip

    def feed(self, frame: Frame) -> list[dict[str, Any]]:
        if self.finished:
            return []
        if frame.kind == "gap":
            if frame.offset < self.first - 1 and not self.started:
                return []  # lost frames of turns before this one
            return self._fail(frame.offset + 1 - self.first, frame.text or "frames were lost")
        if frame.turn != self.rid.turn or frame.offset < self.first:
            return []
        i = frame.offset - self.first
        self.last = max(self.last, i)
        if not self.started:
            if frame.kind != "meta" or i != 0:  # the turn's start is not in the backlog
                return self._fail(i, "the response's first frames are no longer stored")
            return self._start(frame)
        if frame.kind == "token":
            self.text.append(frame.text)
            return self._keep([self._part("response.output_text.delta", i + 3 + self.shift,
                                          delta=frame.text, logprobs=[])])  # fmt: skip
        if frame.kind == "part":
            return self._keep(self._item(frame, i + 3 + self.shift))
        if frame.kind == "done":
            return self._done(frame, i + self.shift)
        if frame.kind == "error":
            code = (frame.meta or {}).get("code")
            self.error_code = code if isinstance(code, str) else None
            return self._fail(i + self.shift, frame.text or "the response failed")
        return []

    def _item(self, frame: Frame, seq: int) -> list[dict[str, Any]]:
        """One part frame's events, from ``seq`` on (see the module docstring)."""
        try:
            ref = frame_part(frame.meta)
        except PartError:
            return []  # not a part this stream can show
        key, text = (ref.part, ref.id), frame.text
        if ref.part == "source":
            v = _json(text)
            v = v if isinstance(v, dict) else {}
            n = len("".join(self.text))
            note = {"type": "url_citation", "url": str(v.get("url", "")),
                    "title": str(v.get("title", "")), "start_index": n, "end_index": n}  # fmt: skip
            self.annotations.append(note)
            return [self._part("response.output_text.annotation.added", seq, annotation=note,
                               annotation_index=len(self.annotations) - 1)]  # fmt: skip
        if ref.part not in ("tool-call", "reasoning"):
            return []
        if ref.phase == "start":
            if ref.part == "tool-call":
                item: dict[str, Any] = {"id": f"fc_{ref.id}", "type": "function_call",
                                        "call_id": ref.id, "name": ref.name, "arguments": "",
                                        "status": "in_progress"}  # fmt: skip
            else:
                item = {"id": f"rs_{ref.id}", "type": "reasoning", "summary": [],
                        "status": "in_progress"}  # fmt: skip
                if not ref.summary:
                    item["content"] = []
            self._at[key] = len(self.items)
            self.items.append(item)
            return [{"type": "response.output_item.added", "sequence_number": seq,
                     "output_index": len(self.items), "item": dict(item)}]  # fmt: skip
        at = self._at.get(key)
        if at is None:
            return []  # its start is not in what was read
        item, index = self.items[at], at + 1
        if ref.phase == "delta" and text:
            if item["type"] == "function_call":
                item["arguments"] += text
                return [{"type": "response.function_call_arguments.delta", "sequence_number": seq,
                         "item_id": item["id"], "output_index": index, "delta": text}]  # fmt: skip
            events = []
            if not item[field := _reasoning_field(item)]:  # its one part opens first
                item[field].append({"type": _REASONING[field][2], "text": ""})
                events.append(self._reasoning_part("added", item, index, seq))
                self.shift += 1
            item[field][0]["text"] += text
            event, where = _REASONING[field][:2]
            events.append({"type": f"response.{event}.delta", "sequence_number": seq + len(events),
                           "item_id": item["id"], "output_index": index, "delta": text,
                           where: 0})  # fmt: skip
            return events
        if ref.phase != "end":
            return []
        item["status"] = "completed"
        out: list[dict[str, Any]] = []
        if item["type"] == "function_call":
            out.append({"type": "response.function_call_arguments.done", "sequence_number": seq,
                        "item_id": item["id"], "output_index": index,
                        "name": item["name"], "arguments": item["arguments"]})  # fmt: skip
            self.shift += 1
        elif item[field := _reasoning_field(item)]:  # its text's done, then its part's
            event, where = _REASONING[field][:2]
            out.append({"type": f"response.{event}.done", "sequence_number": seq,
                        "item_id": item["id"], "output_index": index, where: 0,
                        "text": item[field][0]["text"]})  # fmt: skip
            out.append(self._reasoning_part("done", item, index, seq + 1))
            self.shift += 2
        out.append({"type": "response.output_item.done", "sequence_number": seq + len(out),
                    "output_index": index, "item": dict(item)})  # fmt: skip
        return out

    @staticmethod
    def _reasoning_part(phase: str, item: dict[str, Any], index: int, seq: int) -> dict[str, Any]:
        """A reasoning item's one part, opened (``added``, empty) or closed (``done``)."""
        field = _reasoning_field(item)
        part = (
            dict(item[field][0]) if phase == "done" else {"type": _REASONING[field][2], "text": ""}
        )
        kind = "reasoning_summary_part" if field == "summary" else "content_part"
        return {"type": f"response.{kind}.{phase}", "sequence_number": seq, "item_id": item["id"],
                "output_index": index, _REASONING[field][1]: 0, "part": part}  # fmt: skip

    def fail(self, reason: str) -> list[dict[str, Any]]:
        """End the response with ``response.failed`` (its frames stopped coming, its
        session was deleted); numbered after the newest frame read."""
        if self.finished:
            return []
        return self._fail(self.last + 1, reason)

    def _keep(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [e for e in events if e["sequence_number"] > self.after]

    def _part(self, kind: str, seq: int, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": seq, "item_id": self.rid.message_id,
                "output_index": 0, "content_index": 0, **fields}  # fmt: skip

    def _start(self, frame: Frame) -> list[dict[str, Any]]:
        meta = frame.meta or {}
        params = meta.get("response")
        self.params = dict(params) if isinstance(params, dict) else {}
        self.params.setdefault("model", meta.get("model") or "")
        message = meta.get("message")
        self.message = message if isinstance(message, str) else None
        self.created_at = frame.ts // 1000
        self.started = True
        item = {"id": self.rid.message_id, "type": "message", "role": "assistant",
                "status": "in_progress", "content": []}  # fmt: skip
        resp = self.response()
        resp["output"] = []
        return self._keep([
            {"type": "response.created", "sequence_number": 0, "response": resp},
            {"type": "response.in_progress", "sequence_number": 1, "response": resp},
            {"type": "response.output_item.added", "sequence_number": 2, "output_index": 0,
             "item": item},
            self._part("response.content_part.added", 3, part=self._text_part("")),
        ])  # fmt: skip

    @staticmethod
    def _text_part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _done(self, frame: Frame, i: int) -> list[dict[str, Any]]:
        meta = frame.meta or {}
        finish = meta.get("finish_reason")
        self.status, self.incomplete = _status_of(finish if isinstance(finish, str) else None)
        self.usage = usage(meta)
        self.finished = True
        resp = self.response()
        item = resp["output"][0]
        text = item["content"][0]["text"]
        end = "response.completed" if self.status == "completed" else "response.incomplete"
        return self._keep([
            self._part("response.output_text.done", i + 3, text=text, logprobs=[]),
            self._part("response.content_part.done", i + 4, part=self._text_part(text)),
            {"type": "response.output_item.done", "sequence_number": i + 5, "output_index": 0,
             "item": item},
            {"type": end, "sequence_number": i + 6, "response": resp},
        ])  # fmt: skip

    def _fail(self, i: int, reason: str) -> list[dict[str, Any]]:
        self.finished = True
        self.status, self.error = "failed", reason
        if not self.started:  # nothing of it was read: the object still says what failed
            self.started = True
        failed = {"type": "response.failed", "sequence_number": max(i, 1) + 3,
                  "response": self.response()}  # fmt: skip
        return self._keep([failed])
