"""A screen's conversation, built from frames and from the stored conversation. Pure.

What a chat screen shows: one user message and one reply per turn, in order. It starts
from the worker's ``GET /v1/sessions/{sid}/messages`` page (:meth:`Transcript.load`),
then applies every frame the watch delivers from that page's ``resume_from``
(:meth:`Transcript.apply`):

- ``meta`` opens a turn: its user message (``meta.message``, id ``meta.message_id``)
  and an empty reply; with ``meta.replaces`` = N it first drops turns N and later (a
  regenerate or an edit replaced them: the stored history dropped them too);
- ``token`` appends to its turn's reply; ``part`` adds to or extends one of the reply's
  parts (reasoning, tool calls, tool results, sources, usage, data:
  :mod:`relay.protocol.parts`), and a part frame that does not fit (a delta of a part
  never started, arguments that are not JSON, a part after the reply ended, an unknown
  type) changes nothing and is counted in :attr:`Transcript.refused`; ``done`` ends it
  (``finish`` = its ``finish_reason``: ``cancelled`` for a stopped, partial reply);
  ``error`` ends it with ``finish`` "error" and the reason (such a turn is not stored:
  :meth:`history` leaves it out);
- ``reset`` (the session restarted) clears everything; other kinds change nothing.

:meth:`Transcript.history` is what the worker stores for the same frames: a screen
that applied every frame holds the stored conversation (the chat-controls tests
compare the two).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from relay.protocol.frame import Frame
from relay.protocol.parts import Part, PartError, Parts, frame_part

__all__ = ["Entry", "Transcript"]


@dataclass(slots=True)
class Entry:
    """One message on the screen."""

    turn: int
    role: str  # "user" or "assistant"
    text: str
    id: str | None = None
    finish: str | None = None  # a reply's finish reason; None while it streams
    error: str | None = None  # the reason of a turn that failed
    parts_state: Parts = field(default_factory=Parts, repr=False)

    @property
    def parts(self) -> list[Part]:
        """The reply's parts besides its text, in the order they started."""
        return self.parts_state.records


class Transcript:
    """The messages of one session, in order. See the module docstring."""

    def __init__(self, session: str) -> None:
        self.session = session
        self.entries: list[Entry] = []
        self.refused: list[str] = []  # why each refused part frame was refused

    def load(self, page: dict[str, Any]) -> None:
        """Start from a messages page (``format`` turns); older pages are not merged."""
        self.entries = [
            Entry(
                turn=int(m["turn"]) if isinstance(m.get("turn"), int) else 0,
                role=str(m.get("role")),
                text=str(m.get("text", "")),
                id=m.get("id"),
                finish=m.get("finish_reason"),
                parts_state=Parts.from_stored(m.get("parts")),
            )
            for m in page.get("messages", [])
        ]

    def apply(self, frame: Frame) -> None:
        meta = frame.meta or {}
        if frame.kind == "reset":
            self.entries = []
        elif frame.kind == "meta" and frame.turn > 0:
            replaces = meta.get("replaces")
            if isinstance(replaces, int):
                self.entries = [e for e in self.entries if e.turn < replaces]
            if self._reply(frame.turn) is None:
                self.entries.append(
                    Entry(frame.turn, "user", str(meta.get("message", "")), meta.get("message_id"))
                )
                self.entries.append(
                    Entry(frame.turn, "assistant", "", f"{self.session}-{frame.turn}")
                )
        elif frame.kind == "token":
            reply = self._reply(frame.turn) or self._open(frame.turn)
            reply.text += frame.text
            reply.parts_state.text(frame.text)
        elif frame.kind == "part":
            reply = self._reply(frame.turn) or self._open(frame.turn)
            try:
                ref = frame_part(frame.meta)
                if reply.finish is not None:
                    raise PartError(f"{ref.part} {ref.id!r} after the reply ended")
                reply.parts_state.apply(ref, frame.text, frame.offset)
            except PartError as exc:
                self.refused.append(str(exc))
        elif frame.kind == "done":
            reply = self._reply(frame.turn) or self._open(frame.turn)
            reply.finish = str(meta.get("finish_reason") or "stop")
            reply.parts_state.close()
        elif frame.kind == "error" and frame.turn > 0:
            reply = self._reply(frame.turn) or self._open(frame.turn)
            reply.finish, reply.error = "error", frame.text
            reply.parts_state.close()

    def history(self) -> list[dict[str, Any]]:
        """The conversation as the worker stores it: turns that did not fail, each its
        user message and its reply (``role``, ``content``, ``turn``, and ``parts`` for a
        reply with parts: :meth:`relay.protocol.parts.Parts.stored`)."""
        failed = {e.turn for e in self.entries if e.finish == "error"}
        out: list[dict[str, Any]] = []
        for e in self.entries:
            if e.turn in failed:
                continue
            m: dict[str, Any] = {"role": e.role, "content": e.text, "turn": e.turn}
            if parts := e.parts_state.stored():
                m["parts"] = parts
            out.append(m)
        return out

    def _reply(self, turn: int) -> Entry | None:
        return next(
            (e for e in reversed(self.entries) if e.turn == turn and e.role == "assistant"), None
        )

    def _open(self, turn: int) -> Entry:
        """A reply whose meta frame this screen did not see (it joined mid-turn)."""
        e = Entry(turn, "assistant", "", f"{self.session}-{turn}")
        self.entries.append(e)
        return e
