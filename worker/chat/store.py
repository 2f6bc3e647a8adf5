"""The session store: everything a stateless worker keeps about a session, in Redis.

All keys are built by :mod:`relay.protocol.keys` and share the session's hash slot, so each
operation below is one round trip to one shard (pipelines and Lua stay single-slot):

* ``hist_key(sid)`` list: the chat history, one JSON object per message: ``role``,
  ``content``, and (since turns are numbered in it) ``turn``, ``id`` (the client's
  message id, or ``<sid>-<turn>`` for a reply), ``from`` (the turn's first offset) and,
  on replies, ``to`` (the turn's terminal offset), ``finish`` (the finish reason;
  ``cancelled``: the reply was stopped and is partial) and ``parts`` (its tool calls,
  reasoning, ...); a tool's result that a client sent back is ``role`` ``tool`` with its
  ``tool_call_id`` (both replayed to the engine: :mod:`worker.chat.prompt`); trimmed to the last
  ``max_messages`` and expiring ``ttl_s`` after the last write. A regenerate or an
  edit drops the messages of the turns it replaces (:meth:`SessionStore.truncate_from`);
* ``key(sid, HIST, "state")`` hash: ``system`` (the session's system prompt, replaced
  when a turn sends one) and ``engine`` (the engine that served the last turn, for the
  cache-affinity metric);
* ``key(sid, LOCK)`` string: the turn that currently generates (``<owner> <json>``),
  with a TTL the turn runner refreshes; one turn at a time per session;
* ``idem_key(sid, k)`` string: ``Idempotency-Key`` -> the 202 body of the turn it
  started and the request's fingerprint (``{"turn", "offset", "session", "fp"}``, kept
  ``idem_ttl_s``, an hour: long enough for any retry, short enough that a client posting
  a fresh key with every turn keeps at most an hour of turns' records per session);
  while that turn is being admitted, ``pending <owner> <fp>`` with the turn lock's TTL:
  a worker that dies between claim and resolve holds the key no longer than its lock,
  and a retry after that starts the turn.

Order of use for one turn: :meth:`SessionStore.claim_idempotency` (when the client sent
a key) -> :meth:`acquire_lock` -> :meth:`load` -> (route, open the generation) ->
:meth:`set_lock_turn` and :meth:`resolve_idempotency` -> ... the lock refreshed about
once a second (by the producer API's turn, which also sees a stop asked of it) ... ->
:meth:`append_exchange` on success -> :meth:`release_lock`.
Every read and write is one call of the store port (:class:`relay.broker.port.Store`: on
Redis :class:`relay.broker.rediscluster.store.RedisStore`, whose scripts keep the rules
above; in memory :class:`relay.broker.memstore.MemoryStore`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from relay.broker.port import LockHolder, LockState, Store, parse_lock
from relay.broker.rediscluster.store import RedisStore, state_key
from relay.protocol.keys import SESSION_TTL_S, idem_key
from worker.chat.prompt import history_messages, tool_message

__all__ = ["IDEM_TTL_S", "ConversationView", "History", "LockHolder", "SessionStore", "state_key"]

IDEM_TTL_S: Final = 3600  # how long an Idempotency-Key's record answers a retry


@dataclass(frozen=True, slots=True)
class History:
    """What the prompt is assembled from: ``messages`` (the engine's messages: role and
    content, a reply's tool calls and the tools' results,
    :func:`worker.chat.prompt.history_messages`) and ``entries`` (every stored field:
    turn, id, offsets, finish, parts)."""

    system: str | None
    messages: list[dict[str, Any]]
    last_engine: str | None
    entries: list[dict[str, Any]] = field(default_factory=list)

    def before(self, turn: int) -> list[dict[str, Any]]:
        """The messages of the turns before ``turn`` (what a regenerate or an edit of
        ``turn`` sends to the engine)."""
        return history_messages(
            e for e in self.entries if not isinstance(e.get("turn"), int) or e["turn"] < turn
        )

    def tool_results(self, turn: int) -> list[dict[str, Any]]:
        """The tools' results ``turn`` was sent (its input when it went on after tools)."""
        return [
            tool_message(str(e.get("tool_call_id", "")), str(e.get("content", "")))
            for e in self.entries
            if e.get("turn") == turn and e.get("role") == "tool"
        ]

    def last_turn(self) -> int | None:
        """The newest turn with a stored reply, or None."""
        for e in reversed(self.entries):
            if e.get("role") == "assistant" and isinstance(e.get("turn"), int):
                return int(e["turn"])
        return None

    def user_message(self, turn: int) -> dict[str, Any] | None:
        return next(
            (e for e in self.entries if e.get("turn") == turn and e.get("role") == "user"), None
        )

    def turn_of_message(self, message_id: str) -> int | None:
        """The turn of the stored message with id ``message_id`` (user or reply)."""
        for e in self.entries:
            if e.get("id") == message_id and isinstance(e.get("turn"), int):
                return int(e["turn"])
        return None


@dataclass(frozen=True, slots=True)
class ConversationView:
    """The stored conversation and, read at the same instant, the session's state:
    ``open_turn`` (the turn generating, or None), ``last_turn``, ``last_offset``, the
    turn lock's ``holder`` and the generation ``gen``."""

    entries: list[dict[str, Any]]
    open_turn: int | None
    last_turn: int
    last_offset: int
    holder: LockHolder | None
    gen: str  # the session's generation id ("" before its first turn)


class SessionStore:
    """History, turn lock and idempotency records of sessions, on ``store`` (a cluster
    client is wrapped in a :class:`RedisStore`). Safe to share."""

    def __init__(
        self,
        store: Store | Any,
        *,
        max_messages: int = 64,
        max_bytes: int = 0,
        ttl_s: int = SESSION_TTL_S,
        lock_ttl_s: float = 15.0,
        idem_ttl_s: int = IDEM_TTL_S,
    ) -> None:
        if max_messages < 2:
            raise ValueError("max_messages must be >= 2")
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0 (0: no byte bound)")
        self.store: Store = store if isinstance(store, Store) else RedisStore(store, ttl_s=ttl_s)
        self.max_messages = max_messages
        self.max_bytes = max_bytes  # the history's stored size; 0: messages only
        self.ttl_s = ttl_s
        self.lock_ttl_ms = max(1, int(lock_ttl_s * 1000))
        self.idem_ttl_s = idem_ttl_s

    # ---- history -----------------------------------------------------------------------

    async def load(self, sid: str) -> History:
        """The system prompt, the bounded history and the last engine, in one round trip."""
        raw_hist, state = await self.store.history(sid)
        entries = _entries(raw_hist)
        return History(state.get("system") or None, history_messages(entries),
                       state.get("engine") or None, entries)  # fmt: skip

    async def gone(self, sid: str) -> bool:
        """Whether the session was deleted (its tombstone, ``gone_key``, is there)."""
        return await self.store.gone(sid)

    async def truncate_from(self, sid: str, turn: int) -> int:
        """Drop the messages of ``turn`` and every later turn (a regenerate or an edit
        replaces them); return how many went."""
        return await self.store.truncate_history(sid, turn)

    async def view(self, sid: str) -> ConversationView:
        """The history and the session's turn state, read in one script (one instant)."""
        st = await self.store.session_state(sid)
        holder = parse_lock(st.lock) if st.lock else None
        open_turn = int(st.open) if st.open else None
        return ConversationView(_entries(st.history), open_turn, st.turn, st.offset, holder, st.gen)

    async def save_system(self, sid: str, system: str) -> None:
        await self.store.set_state(sid, "system", system, self.ttl_s)

    async def append_exchange(
        self, sid: str, messages: Sequence[Mapping[str, Any]], engine: str | None
    ) -> None:
        """Append messages (the user's and the assistant's) and remember the engine. The
        oldest messages are dropped past ``max_messages`` or ``max_bytes`` (stored JSON);
        the appended exchange itself always stays."""
        await self.store.append_history(
            sid, [json.dumps(dict(m)) for m in messages], max_messages=self.max_messages,
            max_bytes=self.max_bytes, ttl_s=self.ttl_s,
        )  # fmt: skip
        if engine is not None:
            await self.store.set_state(sid, "engine", engine, self.ttl_s)

    # ---- the turn lock -------------------------------------------------------------------

    async def acquire_lock(self, sid: str, owner: str) -> LockHolder | None:
        """Take the session's turn lock; ``None`` on success, else the current holder."""
        return await self.store.acquire_lock(sid, owner, self.lock_ttl_ms)

    async def set_lock_turn(self, sid: str, owner: str, turn: int, offset: int) -> bool:
        """Name the turn in our lock; False if another owner holds it. A lock that
        expired during a slow admission (nobody took it) is taken again: the generation
        just opened fences every older producer anyway."""
        return await self.store.name_turn(sid, owner, self.lock_ttl_ms, turn, offset)

    async def refresh_lock(self, sid: str, owner: str) -> bool:
        """Extend the lock's TTL; False if it is no longer ours."""
        state = await self.store.refresh_lock(sid, owner, self.lock_ttl_ms, 0)
        return state is not LockState.LOST

    async def release_lock(self, sid: str, owner: str) -> bool:
        return await self.store.release_lock(sid, owner)

    # ---- idempotency ---------------------------------------------------------------------

    async def claim_idempotency(
        self, sid: str, idem: str, owner: str, fp: str = ""
    ) -> dict[str, Any] | str | None:
        """SET NX a pending record (expiring with the turn lock's TTL). ``None``: claimed,
        go ahead; a dict: the stored 202 body of the turn this key already started;
        ``"pending"``: another request with this key is being admitted right now;
        ``"reused"``: the key was used with another request (fingerprint ``fp``)."""
        k = idem_key(sid, idem)
        for _ in range(3):  # the record may expire between SET NX and GET
            cur = await self.store.claim(k, f"pending {owner} {fp}", self.lock_ttl_ms)
            if cur is None:
                return None
            if cur:
                return _idem_state(cur, owner, fp)
        return "pending"

    async def resolve_idempotency(
        self, sid: str, idem: str, body: Mapping[str, Any], fp: str = ""
    ) -> None:
        record = json.dumps({**dict(body), "fp": fp})
        await self.store.put(idem_key(sid, idem), record, self.idem_ttl_s)

    async def drop_idempotency(self, sid: str, idem: str, owner: str) -> None:
        """Forget a pending claim (the turn was not admitted: 409, 429, 503)."""
        await self.store.release(idem_key(sid, idem), f"pending {owner} ")


def _idem_state(text: str, owner: str, fp: str) -> dict[str, Any] | str | None:
    """What a stored Idempotency-Key record means for a request (see claim_idempotency)."""
    if text.startswith("pending "):
        _, who, theirs = [*text.split(" ", 2), ""][:3]
        if theirs and fp and theirs != fp:
            return "reused"
        return None if who == owner else "pending"  # ours: the SET was sent again
    try:
        body = json.loads(text)
    except ValueError:
        return "pending"
    if not isinstance(body, dict):
        return "pending"
    theirs = body.pop("fp", "")
    if theirs and fp and theirs != fp:
        return "reused"
    return body


def _entries(raw: list[Any]) -> list[dict[str, Any]]:
    """The stored messages that decode (``role``, ``content`` and whatever else is kept)."""
    out: list[dict[str, Any]] = []
    for item in raw:
        try:
            m = json.loads(item)
        except ValueError:
            continue
        if isinstance(m, dict) and isinstance(m.get("content"), str):
            m.setdefault("role", "user")
            out.append(m)
    return out
