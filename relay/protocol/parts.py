"""The parts of a reply besides its text: one vocabulary for every producer, front and
client (docs/PROTOCOL.md, "Parts"). Pure: no I/O, no clock.

A reply is its text (the ``token`` frames, unchanged) and its **parts**, each carried by
``part`` frames of the same turn, at the session's offsets like every frame:

- streamed parts, ``reasoning`` and ``tool-call``: a ``start`` frame, any number of
  ``delta`` frames (the frame's ``text`` appends: reasoning text, the call's arguments as
  JSON text) and an ``end`` frame; a ``tool-call``'s arguments must be valid JSON when it
  ends;
- whole parts, ``tool-result``, ``source``, ``usage`` and an application's ``data-<name>``:
  one frame whose ``text`` is the part's value as JSON text.

A part frame's ``meta`` says which part it is: ``part`` (its type), ``id`` (unique among
the turn's parts of its type; a ``tool-result``'s is the call's id), ``phase`` (streamed
parts only), ``name`` (a ``tool-call``'s ``start`` and a ``tool-result``: the tool),
``summary`` (a ``reasoning`` ``start``: true for a reasoning summary) and, on a ``tool-
result``, ``error`` (true: the tool failed, the value is its error).

Order of use: a producer, for each part it writes, :func:`part_meta` (the frame's meta)
through one :class:`Parts` per turn (:meth:`Parts.apply` refuses what would corrupt the
transcript, with :class:`PartError`); its ``done`` frame carries
:func:`parts_integrity` of :attr:`Parts.records`. A client applies each part frame it
receives to its own :class:`Parts` (:func:`frame_part` reads the frame) and checks the
``done`` frame's ``parts`` and ``parts_sha256`` against the same digest.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import msgspec

__all__ = [
    "MAX_PARTS",
    "STREAMED",
    "WHOLE",
    "Part",
    "PartError",
    "PartRef",
    "Parts",
    "Phase",
    "check_type",
    "frame_part",
    "json_text",
    "part_meta",
    "parts_digest",
    "parts_integrity",
    "ui_parts",
]

Phase = Literal["start", "delta", "end"]
STREAMED: Final[frozenset[str]] = frozenset(("reasoning", "tool-call"))
WHOLE: Final[frozenset[str]] = frozenset(("tool-result", "source", "usage"))
MAX_PARTS: Final = 4096  # parts of one turn (each is at least one frame of the backlog)

_ID_RE: Final = re.compile(r"[!-~]{1,128}")  # printable ASCII, no space: ids and tool names
_DATA_RE: Final = re.compile(r"data-[A-Za-z0-9_-]{1,64}")
_json_decoder = msgspec.json.Decoder()
_json_encoder = msgspec.json.Encoder()


class PartError(ValueError):
    """A part that would corrupt the transcript: an unknown type, a delta for a part never
    started, a tool call whose arguments are not JSON, a part after the turn ended, ...
    The message says which and why, in one line."""


def check_type(part: object) -> str:
    """``part`` if it is a type of the vocabulary, else :class:`PartError`."""
    if isinstance(part, str) and (part in STREAMED or part in WHOLE or _DATA_RE.fullmatch(part)):
        return part
    raise PartError(
        f"unknown part type {part!r}: reasoning, tool-call, tool-result, source, usage "
        "or data-<name> ([A-Za-z0-9_-]{1,64})"
    )


def _check_id(what: str, value: object) -> str:
    if not isinstance(value, str) or _ID_RE.fullmatch(value) is None:
        raise PartError(f"{what} must be 1..128 printable ASCII characters, no space: {value!r}")
    return value


def json_text(value: object) -> str:
    """``value`` as the compact JSON text a whole part carries (:class:`PartError` when it
    has no JSON form)."""
    try:
        return _json_encoder.encode(value).decode()
    except (TypeError, ValueError, OverflowError) as exc:
        raise PartError(f"the part's value is not JSON: {exc}") from None


def _is_json(text: str) -> bool:
    try:
        _json_decoder.decode(text)
    except (msgspec.DecodeError, UnicodeError):
        return False
    return True


@dataclass(frozen=True, slots=True)
class PartRef:
    """What a part frame says about its part (its ``meta``'s part fields)."""

    part: str
    id: str
    phase: Phase | None = None
    name: str = ""
    summary: bool = False
    error: bool = False


def part_meta(ref: PartRef) -> dict[str, Any]:
    """The part fields of a frame's ``meta`` (the producer adds ``gen``)."""
    m: dict[str, Any] = {"part": ref.part, "id": ref.id}
    if ref.phase is not None:
        m["phase"] = ref.phase
    if ref.name:
        m["name"] = ref.name
    if ref.summary:
        m["summary"] = True
    if ref.error:
        m["error"] = True
    return m


def frame_part(meta: dict[str, Any] | None) -> PartRef:
    """A part frame's ``meta`` read and checked (:class:`PartError` says what is wrong)."""
    if not isinstance(meta, dict):
        raise PartError("a part frame carries its part in meta")
    part = check_type(meta.get("part"))
    pid = _check_id("a part's id", meta.get("id"))
    phase = meta.get("phase")
    if part in STREAMED:
        if phase not in ("start", "delta", "end"):
            raise PartError(f"a {part} part streams: phase start, delta or end, not {phase!r}")
    elif phase is not None:
        raise PartError(f"a {part} part is whole: it has no phase")
    name = meta.get("name", "")
    if (part == "tool-call" and phase == "start") or part == "tool-result":
        name = _check_id("a tool's name", name)
    elif name:
        name = _check_id("a part's name", name)
    return PartRef(part, pid, phase, name, meta.get("summary") is True, meta.get("error") is True)


@dataclass(slots=True)
class Part:
    """One part of a reply as assembled from its frames: ``text`` is its deltas joined
    (a streamed part) or its value's JSON text (a whole part); ``done``: it ended."""

    part: str
    id: str
    name: str = ""
    text: str = ""
    done: bool = False
    summary: bool = False
    error: bool = False
    offset: int = 0  # the offset of its first frame (0: not known)

    def stored(self) -> dict[str, Any]:
        """The part as a reply's ``parts`` list stores it (the history, ``GET
        .../messages``): ``type``, ``id``, ``text``, and ``name``, ``summary``, ``error``,
        ``done`` false where they apply."""
        d: dict[str, Any] = {"type": self.part, "id": self.id, "text": self.text}
        if self.name:
            d["name"] = self.name
        if self.summary:
            d["summary"] = True
        if self.error:
            d["error"] = True
        if not self.done:
            d["done"] = False
        return d

    def value(self) -> Any:
        """A whole part's value, or a finished tool call's arguments, parsed; else None."""
        if self.part == "reasoning" or not self.done or not self.text:
            return None
        return _json_decoder.decode(self.text)


@dataclass(slots=True)
class Parts:
    """One turn's parts, in the order they started, applied frame by frame.

    :meth:`apply` refuses (:class:`PartError`, nothing changed) a part of an unknown type,
    a ``start`` of a part already started, a ``delta`` or ``end`` of one never started or
    already ended, a whole part written twice, a ``tool-result`` for a call the turn has
    not finished, a tool call whose arguments are not JSON at its ``end``, a whole part
    whose value is not JSON, and any part once :meth:`close` has been called (the turn
    ended)."""

    records: list[Part] = field(default_factory=list)
    closed: bool = False
    _by_key: dict[tuple[str, str], Part] = field(default_factory=dict)
    _order: list[Part | list[str]] = field(default_factory=list)  # text runs and parts

    def text(self, delta: str) -> None:
        """The reply's text went on (so that :meth:`stored` keeps text and parts in the
        order they came)."""
        if self._order and isinstance(self._order[-1], list):
            self._order[-1].append(delta)
        elif delta:
            self._order.append([delta])

    @classmethod
    def from_stored(cls, stored: object) -> Parts:
        """A finished reply's parts from :meth:`stored` (a messages page's ``parts``);
        entries that are not a stored part are skipped. Closed: the reply ended."""
        ps = cls()
        for d in stored if isinstance(stored, list) else ():
            if not isinstance(d, dict) or not isinstance(d.get("text", ""), str):
                continue
            kind, text = d.get("type"), d.get("text", "")
            if kind == "text":
                ps.text(text)
                continue
            try:
                check_type(kind)
            except PartError:
                continue
            pid, name = d.get("id"), d.get("name", "")
            if not isinstance(pid, str) or not isinstance(name, str) or (kind, pid) in ps._by_key:
                continue
            done = d.get("done", True) is not False
            ps._add(Part(str(kind), pid, name, text, done, d.get("summary") is True,
                         d.get("error") is True))  # fmt: skip
        ps.closed = True
        return ps

    def stored(self) -> list[dict[str, Any]]:
        """The reply as an ordered list: ``{"type": "text", "text"}`` for each run of
        text between parts, and each part's :meth:`Part.stored`; empty for a reply
        without parts (its text is all there is)."""
        if not self.records:
            return []
        return [
            {"type": "text", "text": "".join(x)} if isinstance(x, list) else x.stored()
            for x in self._order
        ]

    def get(self, part: str, pid: str) -> Part | None:
        return self._by_key.get((part, pid))

    def open(self) -> list[Part]:
        """The streamed parts started and not ended."""
        return [p for p in self.records if not p.done]

    def apply(self, ref: PartRef, text: str, offset: int = 0) -> Part:
        """Apply one part frame (``text``: the frame's); the part as it now stands."""
        if self.closed:
            raise PartError(f"{ref.part} {ref.id!r} after the turn ended")
        key = (ref.part, ref.id)
        p = self._by_key.get(key)
        if ref.part not in STREAMED:
            if p is not None:
                raise PartError(f"{ref.part} {ref.id!r} was already written")
            if ref.part == "tool-result":
                call = self._by_key.get(("tool-call", ref.id))
                if call is None or not call.done:
                    raise PartError(f"tool-result for call {ref.id!r}, which the turn has not "
                                    "finished")  # fmt: skip
            if not _is_json(text):
                raise PartError(f"{ref.part} {ref.id!r}: its value is not valid JSON")
            return self._add(Part(ref.part, ref.id, ref.name, text, True, error=ref.error,
                                  offset=offset))  # fmt: skip
        if ref.phase == "start":
            if p is not None:
                raise PartError(f"{ref.part} {ref.id!r} was already started")
            if text:
                raise PartError(f"a {ref.part} start carries no text; deltas do")
            return self._add(Part(ref.part, ref.id, ref.name, "", False, ref.summary,
                                  offset=offset))  # fmt: skip
        if p is None:
            raise PartError(f"{ref.phase} for {ref.part} {ref.id!r}, which was never started")
        if p.done:
            raise PartError(f"{ref.phase} for {ref.part} {ref.id!r}, which already ended")
        if ref.phase == "delta":
            p.text += text
            return p
        if text:
            raise PartError(f"a {ref.part} end carries no text; deltas do")
        if ref.part == "tool-call" and not _is_json(p.text):
            raise PartError(f"tool-call {ref.id!r} ({p.name}): its arguments are not valid JSON")
        p.done = True
        return p

    def close(self) -> None:
        """The turn ended: every later part is refused."""
        self.closed = True

    def _add(self, p: Part) -> Part:
        if len(self.records) >= MAX_PARTS:
            raise PartError(f"more than {MAX_PARTS} parts in one turn")
        self.records.append(p)
        self._by_key[(p.part, p.id)] = p
        self._order.append(p)
        return p


def parts_digest(records: list[Part]) -> str:
    """Hex SHA-256 over the parts in the order they started; each part is its type, id
    and name (``summary`` for a reasoning summary), the byte length of its text's UTF-8,
    then the text, separated by U+001F (docs/PROTOCOL.md, "Parts": the same in every
    language)."""
    h = hashlib.sha256()
    for p in records:
        name = "summary" if p.summary else p.name
        raw = p.text.encode("utf-8", "surrogatepass")
        h.update(f"{p.part}\x1f{p.id}\x1f{name}\x1f{len(raw)}\x1f".encode())
        h.update(raw)
    return h.hexdigest()


def parts_integrity(records: list[Part]) -> dict[str, Any]:
    """The ``done`` frame's fields for a turn's parts: ``parts`` (how many) and
    ``parts_sha256`` (:func:`parts_digest`); nothing for a turn without parts, so that a
    text-only reply's ``done`` frame is what it was."""
    if not records:
        return {}
    return {"parts": len(records), "parts_sha256": parts_digest(records)}


def _json_or_text(text: str) -> Any:
    try:
        return _json_decoder.decode(text)
    except (msgspec.DecodeError, UnicodeError):
        return text


def ui_parts(stored: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored reply's parts (:meth:`Parts.stored`) as the AI SDK's UI message parts:
    ``text``, ``reasoning``, ``tool-<name>`` (a call with its result folded in:
    ``state`` ``input-streaming``, ``input-available``, ``output-available`` or
    ``output-error``), ``source-url``, ``data-<name>``; a ``usage`` part has no UI part."""
    out: list[dict[str, Any]] = []
    calls: dict[str, dict[str, Any]] = {}
    for d in stored:
        kind, text = d.get("type"), str(d.get("text", ""))
        done = d.get("done", True) is not False
        if kind == "text":
            out.append({"type": "text", "text": text, "state": "done"})
        elif kind == "reasoning":
            out.append({"type": "reasoning", "id": d.get("id"), "text": text,
                        "state": "done" if done else "streaming"})  # fmt: skip
        elif kind == "tool-call":
            call: dict[str, Any] = {
                "type": f"tool-{d.get('name', '')}",
                "toolCallId": d.get("id"),
                "state": "input-available" if done else "input-streaming",
                "input": _json_or_text(text) if done else None,
            }
            calls[str(d.get("id"))] = call
            out.append(call)
        elif kind == "tool-result":
            call = calls.get(str(d.get("id"))) or {}
            if call:
                if d.get("error"):
                    v = _json_or_text(text)
                    call["state"], call["errorText"] = (
                        "output-error",
                        v if isinstance(v, str) else text,
                    )
                else:
                    call["state"], call["output"] = "output-available", _json_or_text(text)
        elif kind == "source":
            v = _json_or_text(text)
            v = v if isinstance(v, dict) else {}
            src = {"type": "source-url", "sourceId": d.get("id"), "url": v.get("url", "")}
            if "title" in v:
                src["title"] = v["title"]
            out.append(src)
        elif isinstance(kind, str) and kind.startswith("data-"):
            out.append({"type": kind, "id": d.get("id"), "data": _json_or_text(text)})
    return out
