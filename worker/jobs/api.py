"""``/v1/jobs`` on the worker: submit an offline job, then poll it (enabled by ``--amqp``).

* ``POST /v1/jobs`` with ``{"prompt": str, "system"?: str, "max_tokens"?: int,
  "session"?: sid}`` and optionally ``Idempotency-Key`` -> ``202 {"job", "status"}``
  (``Location: /v1/jobs/<id>``) once the record is in Redis **and** the broker confirmed
  the message; the same key again returns the same job (``Idempotent-Replayed: true``).
* ``GET /v1/jobs/{id}`` -> ``200 {"job", "status", "attempts", ...}``: ``queued``,
  ``running`` (with ``progress_tokens``), ``done`` (with ``result``, ``tokens``,
  ``chars``, ``sha256``) or ``failed`` (with ``error``).

Without ``--amqp`` both answer 404 ``jobs_disabled`` with the reason.

Auth: a job of a session takes that session's token (``write`` to submit; any scope to
read); a job without a session takes a worker API key (``--gateway-key``), which may read
any job but never submit one into a session (403 ``session_token_required``). With
``--insecure-no-auth`` nothing is checked. Errors: ``{"error": code, "reason"}`` with 400,
401/403, 404 ``job_not_found``, 413, 415, 503 ``queue_unavailable`` (+ ``Retry-After``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Final

import orjson
from aiohttp import web

from relay.broker.errors import RelayError
from relay.protocol.auth import AuthError, Scope
from relay.protocol.codes import Refusal
from relay.protocol.keys import InvalidSessionId, parse_session
from relay.service import httpbody
from relay.service.apikeys import check_api_key
from relay.service.errors import RETRY_AFTER, refusal
from relay.service.jsonbody import BodyRefused
from relay.service.register import Handler
from worker.access import WorkerAccess
from worker.jobs.queue import JobSubmitter
from worker.jobs.record import JobSpec, JobStore, new_job_id, parse_job_id, public_view

__all__ = ["JOBS", "JobsApi", "handlers"]

log = logging.getLogger(__name__)
_JSON: Final = "application/json"


@dataclass(slots=True)
class JobsApi:
    store: JobStore
    submitter: JobSubmitter
    access: WorkerAccess  # the worker's token rules (keys None: --insecure-no-auth)
    api_keys: tuple[str, ...]
    default_max_tokens: int
    max_tokens_limit: int
    max_prompt_chars: int
    max_body_bytes: int = 64 * 1024  # the worker's --max-body-bytes


JOBS: Final = web.AppKey("tokenrelay_jobs", JobsApi)


def _auth(
    api: JobsApi, request: web.Request, session: str | None, need: Scope
) -> web.Response | None:
    if api.access.keys is None:
        return None
    header = request.headers.get("Authorization")
    if check_api_key(api.api_keys, header) is None:
        if session is not None and need == "write":  # its result would land in the session
            reason = "a worker API key cannot write into a session: submit with its write token"
            return refusal(403, Refusal.SESSION_TOKEN_REQUIRED, reason)
        return None  # the operator's key may submit session-less jobs and read any job
    if session is not None:
        try:
            api.access.authorize(request, session, need)
            return None
        except AuthError as exc:
            return refusal(exc.status, exc.error, exc.reason)
    return refusal(401, Refusal.MISSING_API_KEY, "a job without a session needs a worker API "
                   "key (--gateway-key)")  # fmt: skip


def _spec(body: Any, api: JobsApi) -> JobSpec:
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("'prompt' must be a non-empty string")
    if len(prompt) > api.max_prompt_chars:
        raise OverflowError(f"'prompt' longer than {api.max_prompt_chars} characters")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise ValueError("'system' must be a string")
    mt = body.get("max_tokens", api.default_max_tokens)
    if isinstance(mt, bool) or not isinstance(mt, int) or not 1 <= mt <= api.max_tokens_limit:
        raise ValueError(f"'max_tokens' must be an integer between 1 and {api.max_tokens_limit}")
    session = body.get("session")
    if session is not None:
        try:
            session = parse_session(session)
        except InvalidSessionId as exc:
            raise ValueError(f"'session': {exc}") from None
    return JobSpec(prompt=prompt, system=system or None, max_tokens=mt, session=session)


def _disabled() -> web.Response:
    reason = "this worker has no job queue: start it with --amqp URL"
    return refusal(404, Refusal.JOBS_DISABLED, reason)


def _store_unavailable() -> web.Response:
    reason = "the job store is unavailable; retry"
    return refusal(503, Refusal.REDIS_UNAVAILABLE, reason, RETRY_AFTER)


async def submit_job(request: web.Request) -> web.Response:
    if JOBS not in request.app:
        return _disabled()
    api = request.app[JOBS]
    try:
        body = await httpbody.read_json(request, api.max_body_bytes, want_object=False)
    except BodyRefused as r:  # 415, 413, 400, or the client gone (counted by the guard)
        return httpbody.refused(r)
    try:
        spec = _spec(body, api)
    except OverflowError as exc:
        return refusal(413, Refusal.PROMPT_TOO_LARGE, str(exc))
    except ValueError as exc:
        return refusal(400, Refusal.INVALID_JOB, str(exc))
    refused = _auth(api, request, spec.session, "write")
    if refused is not None:
        return refused
    idem = request.headers.get("Idempotency-Key")
    if idem is not None and not (0 < len(idem) <= 128 and idem.isprintable() and idem.isascii()):
        return refusal(400, Refusal.INVALID_IDEMPOTENCY_KEY, "1-128 printable ASCII characters")
    job_id = new_job_id()
    owner = spec.session or "api-key"
    try:
        if idem is not None:
            prior = await api.store.claim_idempotency(idem, owner, job_id)
            if prior is not None:
                return web.Response(
                    status=202, content_type=_JSON,
                    body=orjson.dumps({"job": prior, "status": "queued"}),
                    headers={"Location": f"/v1/jobs/{prior}", "Idempotent-Replayed": "true"},
                )  # fmt: skip
        await api.store.create(job_id, spec)
    except RelayError:
        return _store_unavailable()
    try:
        await api.submitter.submit(job_id)
    except Exception as exc:  # any broker failure: the job is not queued, say so
        log.warning("job %s not queued: %s: %s", job_id, type(exc).__name__, str(exc)[:200])
        try:
            await api.store.delete(job_id)
            if idem is not None:
                await api.store.drop_idempotency(idem, owner)
        except RelayError:
            pass  # the record expires with its TTL; it was never queued
        reason = "the job queue is unavailable; retry"
        return refusal(503, Refusal.QUEUE_UNAVAILABLE, reason, {"Retry-After": "2"})
    return web.Response(
        status=202, content_type=_JSON,
        body=orjson.dumps({"job": job_id, "status": "queued"}),
        headers={"Location": f"/v1/jobs/{job_id}"},
    )  # fmt: skip


async def get_job(request: web.Request) -> web.Response:
    if JOBS not in request.app:
        return _disabled()
    api = request.app[JOBS]
    try:
        job_id = parse_job_id(request.match_info["job"])
    except ValueError as exc:
        return refusal(400, Refusal.INVALID_JOB_ID, str(exc))
    try:
        rec = await api.store.get(job_id)
    except RelayError:
        return _store_unavailable()
    if rec is None:  # ids are 128 random bits: saying "no such id" reveals nothing
        return refusal(404, Refusal.JOB_NOT_FOUND, "no such job (or it expired)")
    refused = _auth(api, request, rec.get("session") or None, "watch")
    if refused is not None:
        return refused
    return web.Response(body=orjson.dumps(public_view(job_id, rec)), content_type=_JSON)


def handlers() -> dict[str, Handler]:
    """The jobs API's handlers, by their names in relay/service/routes.py."""
    return {"jobs.submit": submit_job, "jobs.get": get_job}
