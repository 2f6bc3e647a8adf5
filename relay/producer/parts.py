"""A turn's parts besides its text, as the producer writes them: reasoning, tool calls,
tool results, sources, usage and an application's ``data-*`` parts (the vocabulary and
its frames: :mod:`relay.protocol.parts`, docs/PROTOCOL.md "Parts").

:class:`TurnParts` is the half of :class:`relay.producer.turn.Turn` that writes them.
Every call checks the part against the turn's parts first (:class:`PartError`, nothing
written: an unknown type, a delta for a call never started, arguments that are not JSON
when the call ends, a part after the turn ended) and then queues its frame on the turn's
pump, after everything written before it: text and parts keep the order they were
written in. None blocks.

By hand::

    turn.reasoning("Let me think")               # starts a reasoning part, appends
    turn.end_reasoning()
    turn.tool_call("call_1", "weather", {"city": "Oslo"})   # the whole call
    turn.tool_call_start("call_2", "search"); turn.tool_call_delta("call_2", '{"q":')
    turn.tool_call_delta("call_2", '"tides"}'); turn.tool_call_end("call_2")
    turn.tool_result("call_1", {"temp": 4})
    turn.source("https://example.org/tides", title="Tides")
    turn.data("weather", {"city": "Oslo", "temp": 4})
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any

from relay.producer.base import MAX_DELTA_BYTES, Usage
from relay.producer.coalesce import TokenPump
from relay.producer.errors import FrameTooLarge
from relay.protocol.parts import (
    STREAMED,
    Part,
    PartError,
    PartRef,
    Parts,
    check_type,
    json_text,
    part_meta,
    parts_integrity,
)

__all__ = ["PartError", "TurnParts"]


class TurnParts:
    """The part-writing half of a turn (see the module docstring)."""

    def __init__(self, pump: TokenPump, check: Callable[[], None]) -> None:
        self._parts_pump = pump
        self._parts_check = check
        self.parts = Parts()
        self._reasoning: str | None = None  # the reasoning part :meth:`reasoning` appends to
        self._ids = itertools.count(1)

    # ---- the low-level calls: one frame each -------------------------------------------

    def part_start(self, part: str, pid: str, *, name: str = "", summary: bool = False) -> None:
        """Start a streamed part (``reasoning``, ``tool-call``: ``name`` is the tool)."""
        if check_type(part) not in STREAMED:
            raise PartError(f"a {part} part is whole: write it with part()")
        self._apply(PartRef(part, pid, "start", name, summary), "")

    def part_delta(self, part: str, pid: str, text: str) -> None:
        """Append ``text`` to a started part (coalesced with its neighbours like text)."""
        if not isinstance(text, str):
            raise TypeError("a delta is a str")
        if not text:
            return
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > MAX_DELTA_BYTES:
            raise FrameTooLarge(self._parts_sid(), size, MAX_DELTA_BYTES)
        self._apply(PartRef(part, pid, "delta"), text)

    def part_end(self, part: str, pid: str) -> None:
        """End a streamed part (a tool call's arguments must be JSON by now)."""
        self._apply(PartRef(part, pid, "end"), "")

    def part(self, part: str, pid: str, value: Any, *, name: str = "", error: bool = False) -> None:
        """Write a whole part (``tool-result``, ``source``, ``usage``, ``data-<name>``):
        ``value`` is sent as its JSON text."""
        if check_type(part) in STREAMED:
            raise PartError(f"a {part} part streams: part_start, part_delta, part_end")
        text = json_text(value)
        size = len(text.encode())
        if size > MAX_DELTA_BYTES:
            raise FrameTooLarge(self._parts_sid(), size, MAX_DELTA_BYTES)
        self._apply(PartRef(part, pid, None, name, error=error), text)

    # ---- the convenient calls ------------------------------------------------------------

    def reasoning(self, text: str, *, summary: bool = False, pid: str | None = None) -> str:
        """Append ``text`` to the reasoning part being written (started when none is, or
        when ``pid`` names another, which ends the one before); returns its id.
        :meth:`end_reasoning` ends it, and so do the next text delta and ``done``."""
        current = self._reasoning
        if current is None or (pid is not None and pid != current):
            if current is not None:
                self.end_reasoning()
            pid = pid or f"reasoning-{next(self._ids)}"
            self.part_start("reasoning", pid, summary=summary)
            self._reasoning = pid
        assert self._reasoning is not None
        self.part_delta("reasoning", self._reasoning, text)
        return self._reasoning

    def end_reasoning(self) -> None:
        """End the reasoning part :meth:`reasoning` is writing (none: nothing to do)."""
        if self._reasoning is not None:
            pid, self._reasoning = self._reasoning, None
            p = self.parts.get("reasoning", pid)
            if p is not None and not p.done:
                self.part_end("reasoning", pid)

    def forget_reasoning(self, pid: str) -> None:
        """``pid`` was ended by hand: :meth:`reasoning` starts a new part next time."""
        if self._reasoning == pid:
            self._reasoning = None

    def tool_call_start(self, call_id: str, name: str) -> None:
        self.part_start("tool-call", call_id, name=name)

    def tool_call_delta(self, call_id: str, arguments: str) -> None:
        self.part_delta("tool-call", call_id, arguments)

    def tool_call_end(self, call_id: str) -> None:
        self.part_end("tool-call", call_id)

    def tool_call(self, call_id: str, name: str, arguments: str | Mapping[str, Any]) -> None:
        """The complete call: its arguments as JSON text or as an object. Checked before
        anything is written (arguments that are not JSON: :class:`PartError`)."""
        text = arguments if isinstance(arguments, str) else json_text(dict(arguments))
        if self.parts.get("tool-call", call_id) is not None:
            raise PartError(f"tool-call {call_id!r} was already started")
        probe = Parts()
        probe.apply(PartRef("tool-call", call_id, "start", name), "")
        if text:
            probe.apply(PartRef("tool-call", call_id, "delta"), text)
        probe.apply(PartRef("tool-call", call_id, "end"), "")
        self.tool_call_start(call_id, name)
        self.tool_call_delta(call_id, text)
        self.tool_call_end(call_id)

    def tool_result(self, call_id: str, output: Any, *, error: bool = False) -> None:
        """The result of the turn's finished call ``call_id`` (``error``: the tool failed
        and ``output`` says how)."""
        call = self.parts.get("tool-call", call_id)
        self.part("tool-result", call_id, output, name=call.name if call else "", error=error)

    def source(self, url: str, *, title: str | None = None, pid: str | None = None) -> str:
        """A source the reply cites; returns its id."""
        pid = pid or f"source-{next(self._ids)}"
        value: dict[str, Any] = {"url": url}
        if title is not None:
            value["title"] = title
        self.part("source", pid, value)
        return pid

    def usage(self, usage: Usage | Mapping[str, Any], *, pid: str | None = None) -> str:
        """Usage as the stream reports it (a step's, say); the turn's own goes into
        ``done``. Returns its id."""
        pid = pid or f"usage-{next(self._ids)}"
        value = usage.meta()["usage"] if isinstance(usage, Usage) else dict(usage)
        self.part("usage", pid, value)
        return pid

    def data(self, name: str, value: Any, *, pid: str | None = None) -> str:
        """An application's own part ``data-<name>``; returns its id."""
        pid = pid or f"data-{next(self._ids)}"
        self.part(f"data-{name}", pid, value)
        return pid

    # ---- the turn's end --------------------------------------------------------------------

    def end_open_parts(self) -> None:
        """End every streamed part still open (checked first: a tool call whose
        arguments are not JSON raises :class:`PartError` and nothing is ended)."""
        still = self.parts.open()
        for p in still:
            if p.part == "tool-call":
                probe = Parts()
                probe.apply(PartRef(p.part, p.id, "start", p.name), "")
                probe.apply(PartRef(p.part, p.id, "delta"), p.text)
                probe.apply(PartRef(p.part, p.id, "end"), "")
        for p in still:
            self.part_end(p.part, p.id)
        self._reasoning = None

    def parts_integrity(self) -> dict[str, Any]:
        return parts_integrity(self.parts.records)

    def close_parts(self) -> None:
        self.parts.close()

    @property
    def part_records(self) -> list[Part]:
        return self.parts.records

    # ---- inside ---------------------------------------------------------------------------

    def _parts_sid(self) -> str:
        return str(getattr(self, "sid", ""))

    def _apply(self, ref: PartRef, text: str) -> None:
        self._parts_check()
        self.parts.apply(ref, text)
        meta = part_meta(ref)
        if ref.phase == "delta":
            self._parts_pump.push(text, meta)
        else:
            self._parts_pump.put(meta, text)
