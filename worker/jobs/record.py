"""Offline jobs: the record of a job in Redis and the rules that keep one result per job.

A job is a long generation (a report, a batch item) that must survive restarts and be
shaved off peaks, so it travels on a real message queue (:mod:`worker.jobs.queue`,
RabbitMQ) and not on Pub/Sub. This module holds what does not depend on the broker:

- :class:`JobSpec`: what the client asked for (prompt, system, max_tokens, session);
- :class:`JobStore`: the job's record in the store, one hash ``tr:job:{<id>}`` with a
  TTL, changed only by the store's atomic steps (on Redis, Lua scripts:
  :mod:`relay.broker.rediscluster.store`) whose rules make retries safe:

  =============  ============================================================
  script         rule
  =============  ============================================================
  create         a fresh record, ``queued`` (a job id is random: never taken)
  start          ``attempts`` + 1 and ``running``, unless already ``done`` or
                 ``failed`` (a redelivered message of a finished job is a no-op)
  progress       tokens so far, only while ``running``
  finish         stores the result and ``done`` unless a result is stored already:
                 however many deliveries finish, exactly one result is kept
  fail           ``failed`` with the reason, unless ``done``
  note           extra fields (``notified``) on a record that exists
  =============  ============================================================

Order of use: the API ``create``s then publishes; a job runner ``start``s on each
delivery, ``progress``es, then ``finish``es (or ``fail``s) and only then acks.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from relay.broker.port import RecordStore
from relay.broker.rediscluster.store import RedisStore
from relay.protocol.keys import SESSION_TTL_S, parse_session

__all__ = [
    "JOB_ID_RE",
    "JOB_TTL_S",
    "JobSpec",
    "JobStore",
    "job_idem_key",
    "job_key",
    "new_job_id",
    "parse_job_id",
    "within_reserve",
]

JOB_ID_RE: Final = "[A-Za-z0-9_-]{22}"
# A job's record lives as long as a session does: a job of a session reports there, and a
# client polls its result about as long as it keeps the session.
JOB_TTL_S: Final = SESSION_TTL_S
_ALPHABET: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def within_reserve(held_here: int, held_elsewhere: int, cap: int, reserve: int) -> bool:
    """Jobs run only in an engine's slots above the ``reserve`` kept for chat: a job may
    hold a slot while everything held on the engine (this job's included, by every
    worker) stays within ``cap - reserve`` (at least 1)."""
    return held_here + held_elsewhere <= max(1, cap - reserve)


def new_job_id() -> str:
    """128 random bits, URL-safe (22 characters)."""
    return secrets.token_urlsafe(16)


def parse_job_id(raw: str) -> str:
    if len(raw) != 22 or not set(raw) <= _ALPHABET:
        raise ValueError("a job id is 22 characters of A-Z a-z 0-9 _ -")
    return raw


def job_key(job_id: str) -> str:
    """The job's record; the id is its hash tag."""
    return f"tr:job:{{{parse_job_id(job_id)}}}"


def job_idem_key(idempotency_key: str, owner: str) -> str:
    """Idempotency-Key -> job id, per caller (a digest: any printable key is safe)."""
    digest = hashlib.sha256(f"{owner}\0{idempotency_key}".encode()).hexdigest()[:32]
    return f"tr:jobidem:{{{digest}}}"


@dataclass(frozen=True, slots=True)
class JobSpec:
    prompt: str
    system: str | None = None
    max_tokens: int = 1024
    session: str | None = None

    def __post_init__(self) -> None:
        if self.session is not None:
            parse_session(self.session)
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")

    def messages(self) -> list[dict[str, str]]:
        sys = [{"role": "system", "content": self.system}] if self.system else []
        return [*sys, {"role": "user", "content": self.prompt}]


def _flat(fields: Mapping[str, Any]) -> dict[str, str]:
    """The fields a record keeps: every one that is not None, as text."""
    return {k: str(v) for k, v in fields.items() if v is not None}


def _now_ms() -> int:
    return int(time.time() * 1000)


class JobStore:
    """Job records on the store port (see the module docstring for the rules: the
    store's :class:`relay.broker.port.RecordStore` keeps them; a cluster client is
    wrapped in a :class:`RedisStore`)."""

    def __init__(self, store: RecordStore | Any, ttl_s: int = JOB_TTL_S) -> None:
        self.store: RecordStore = store if isinstance(store, RecordStore) else RedisStore(store)
        self.ttl_s = ttl_s

    async def create(self, job_id: str, spec: JobSpec) -> None:
        fields = {
            "status": "queued",
            "prompt": spec.prompt,
            "system": spec.system,
            "max_tokens": spec.max_tokens,
            "session": spec.session,
            "attempts": 0,
            "created_ms": _now_ms(),
        }
        await self.store.job_create(job_key(job_id), _flat(fields), self.ttl_s)

    async def claim_idempotency(self, idem: str, owner: str, job_id: str) -> str | None:
        """None: ``job_id`` now answers for this key; else the job it already names."""
        k = job_idem_key(idem, owner)
        prior: str | None = ""
        for _ in range(3):  # the record may expire between SET NX and GET
            prior = await self.store.claim(k, job_id, self.ttl_s * 1000)
            if prior != "":
                break
        return prior

    async def drop_idempotency(self, idem: str, owner: str) -> None:
        await self.store.drop(job_idem_key(idem, owner))

    async def get(self, job_id: str) -> dict[str, str] | None:
        return await self.store.job_get(job_key(job_id))

    async def delete(self, job_id: str) -> None:
        await self.store.drop(job_key(job_id))

    async def start(self, job_id: str, worker: str) -> tuple[str, int]:
        """(status, attempt): ``running`` with this delivery's attempt number, or the
        terminal status / ``missing`` (nothing to run)."""
        return await self.store.job_start(job_key(job_id), worker, _now_ms())

    async def progress(self, job_id: str, tokens: int) -> None:
        await self.store.job_progress(job_key(job_id), tokens, _now_ms())

    async def finish(self, job_id: str, result: Mapping[str, Any]) -> bool:
        """Store the result; False when one is stored already (a second delivery)."""
        fields = _flat({**result, "updated_ms": _now_ms()})
        return await self.store.job_finish(job_key(job_id), fields, self.ttl_s)

    async def note(self, job_id: str, fields: Mapping[str, Any]) -> None:
        """Extra fields on an existing record (e.g. whether its session was told)."""
        await self.store.job_note(job_key(job_id), _flat(fields))

    async def fail(self, job_id: str, reason: str) -> bool:
        return await self.store.job_fail(job_key(job_id), reason, _now_ms())


def public_view(job_id: str, rec: Mapping[str, str]) -> dict[str, Any]:
    """What ``GET /v1/jobs/{id}`` shows: status, progress, and the result once done."""
    out: dict[str, Any] = {
        "job": job_id,
        "status": rec.get("status", "unknown"),
        "attempts": int(rec.get("attempts", "0")),
        "created_ms": int(rec.get("created_ms", "0")),
    }
    if rec.get("session"):
        out["session"] = rec["session"]
    if "progress_tokens" in rec:
        out["progress_tokens"] = int(rec["progress_tokens"])
    if out["status"] == "done":
        out["result"] = rec.get("result", "")
        for k in ("tokens", "chars"):
            if k in rec:
                out[k] = int(rec[k])
        if "notified" in rec:
            out["notified"] = rec["notified"] == "1"
        for k in ("sha256", "engine", "finish_reason", "notify_error"):
            if k in rec:
                out[k] = rec[k]
    if out["status"] == "failed":
        out["error"] = rec.get("error", "")
    return out
