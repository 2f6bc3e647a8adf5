"""Regenerate and edit: which stored turn a new turn replaces. Pure (no I/O).

A turn may replace an earlier one and every turn after it:

* **regenerate** (no new message): the replaced turn's user message is asked again;
  :class:`Replace` with neither ``turn`` nor ``message_id`` means the newest turn with
  a stored reply;
* **edit** (a new message): the replaced turn's user message is the new one.

A turn that went on after tools (its input the tools' results, no user message) is
replaced with the same results (:meth:`worker.chat.store.History.tool_results`; an edit
adds the new message after them).

The replaced turn is named by its number (``turn``, the turn API) or by the id of one
of its stored messages (``message_id``, the AI SDK: the user message it edits, or the
reply it regenerates). :func:`resolve_replace` reads it off the session's history; the
prompt is then the history before that turn (:meth:`worker.chat.store.History.before`),
the replaced messages leave the history when the new turn is admitted, and the new
turn's ``meta`` frame carries ``replaces`` (docs/PROTOCOL.md) so that every screen
drops them too.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.chat.store import History

__all__ = ["NothingToRegenerate", "Replace", "UnknownReplaced", "resolve_replace"]


@dataclass(frozen=True, slots=True)
class Replace:
    """The turn a new turn replaces: by number, by a stored message's id, or (neither)
    the newest turn with a reply."""

    turn: int | None = None
    message_id: str | None = None

    def key(self) -> str:
        """What an Idempotency-Key's fingerprint holds of it."""
        return f"{self.turn}:{self.message_id}"


class NothingToRegenerate(Exception):
    """A regenerate of a session with no stored reply (-> 409)."""


class UnknownReplaced(Exception):
    """The turn or message id to replace is not in the history (-> 404). ``what``:
    ``turn`` or ``message``."""

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(reason)
        self.what = what


def resolve_replace(
    hist: History, replaces: Replace | None, message: str | None
) -> tuple[int | None, str, str | None]:
    """The turn replaced (None: none), the new turn's user message, and the replaced user
    message's id (a regenerate or an edit keeps it; None: none stored)."""
    if replaces is None:
        if message is None:
            raise ValueError("a turn that replaces none needs a message")
        return None, message, None
    turn = replaces.turn
    if replaces.message_id is not None:
        turn = hist.turn_of_message(replaces.message_id)
        if turn is None:
            raise UnknownReplaced(
                "message", f"no message {replaces.message_id!r} in the session's history"
            )
    elif turn is None:
        turn = hist.last_turn()
        if turn is None:
            raise NothingToRegenerate("the session has no reply to regenerate yet")
    user = hist.user_message(turn)
    if user is None and hist.tool_results(turn):  # a turn that went on after tools
        return turn, message if message is not None else "", None
    if user is None:
        raise UnknownReplaced("turn", f"turn {turn} is not in the session's history")
    uid = user.get("id")
    text = message if message is not None else str(user["content"])
    return turn, text, uid if isinstance(uid, str) else None
