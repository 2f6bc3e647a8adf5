"""The one shape of a refused request: ``{"error": code, "reason": sentence, ...}``.

Every HTTP route of the relay and the worker (sessions, turns, tokens, jobs, the AI SDK
chat, the streams) answers what it refuses with :func:`refusal`, or raises
:class:`Reject`, which carries the same and becomes the same response. ``error`` is a
:class:`relay.protocol.codes.Refusal` (a stable code for machines), ``reason`` a
sentence for people; a route may add fields a client can act on (the running turn of a
409, ``retry_after_s`` of a 429). The OpenAI-compatible routes (chat completions, the
Responses API, on the worker and the relay) answer in OpenAI's own error shape instead,
because the SDKs parse that one: :func:`openai_refusal`, the one function that writes it.
Durable Streams answers as its protocol does, the reason as plain text:
:func:`text_refusal`.
A path no route has, or a method its routes lack, is answered by :func:`unrouted` in
the shape of the front the path belongs to (:func:`relay.service.routes.front_of`):
OpenAI's for the OpenAI and Responses fronts, this one for every other path.

Order of use::

    return refusal(400, Refusal.INVALID_SESSION, str(exc))
    raise Reject(429, Refusal.TOO_MANY_STREAMS, "close one", {"Retry-After": "5"})
    except Reject as r: return r.response()
    return openai_refusal(413, "the request body is too large", code="body_too_large")

:data:`RETRY_AFTER` is the header of "come back in a second" (a drain, Redis away);
:func:`retry_after` the one of an estimated wait (whole seconds, at least one).
:func:`admin_refused` answers a request to an operator's endpoint that may not read it
(the rule: :mod:`relay.service.admin`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Final

import orjson
from aiohttp import hdrs, web

from relay.protocol.codes import Refusal
from relay.service.admin import ADMIN_REALM, admin_refusal
from relay.service.routes import Front, front_of

__all__ = [
    "OPENAI_SHAPED",
    "RETRY_AFTER",
    "Reject",
    "admin_refused",
    "error_body",
    "openai_refusal",
    "refusal",
    "retry_after",
    "text_refusal",
    "unrouted",
]

RETRY_AFTER: Final = {"Retry-After": "1"}
# the fronts whose clients (OpenAI's SDKs) parse OpenAI's error body
OPENAI_SHAPED: Final = frozenset({Front.OPENAI, Front.RESPONSES})
_PATH_SAID: Final = 120  # characters of a refused path said back in its reason


def retry_after(seconds: float) -> dict[str, str]:
    """``Retry-After`` for a wait of about ``seconds``: whole seconds, rounded up, >= 1."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def refusal(
    status: int, error: str, reason: str, headers: Mapping[str, str] | None = None, **extra: Any
) -> web.Response:
    """The JSON answer to a refused request (``extra``: more fields of the body)."""
    body = orjson.dumps({"error": error, "reason": reason, **extra})
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def error_body(
    message: str, kind: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error body (every OpenAI route of the worker and the relay answers it:
    :func:`openai_refusal`, and an error event of a streamed answer)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def openai_refusal(
    status: int,
    message: str,
    *,
    kind: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    """OpenAI's answer to a refused request: ``{"error": {"message", "type", "param",
    "code"}}`` (``kind`` is its ``type``)."""
    body = orjson.dumps(error_body(message, kind, code, param))
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def text_refusal(
    status: int, reason: str, headers: Mapping[str, str] | None = None
) -> web.Response:
    """A refusal whose body is its reason as plain text (Durable Streams' convention);
    a ``Content-Type`` among ``headers`` (a stream's own) is not sent with it."""
    h = {k: v for k, v in (headers or {}).items() if k.lower() != "content-type"}
    return web.Response(status=status, text=reason + "\n", headers=h)


class Reject(Exception):
    """A request refused before it is served; :meth:`response` is its answer."""

    def __init__(
        self,
        status: int,
        error: str,
        reason: str,
        headers: Mapping[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(f"{status} {error}: {reason}")
        self.status, self.error, self.reason = status, error, reason
        self.headers = dict(headers or {})
        self.extra = extra

    def response(self) -> web.Response:
        return refusal(self.status, self.error, self.reason, self.headers, **self.extra)


def admin_refused(request: web.Request, key: bytes | None) -> Reject | None:
    """None when ``request`` may read an operator's endpoint (``/metrics``,
    ``/v1/router``); else its 401 / 403 refusal (:mod:`relay.service.admin`)."""
    forwarded = hdrs.X_FORWARDED_FOR in request.headers or hdrs.FORWARDED in request.headers
    refused = admin_refusal(key, request.headers.get(hdrs.AUTHORIZATION), request.remote,
                            forwarded)  # fmt: skip
    if refused is None:
        return None
    headers = {"WWW-Authenticate": ADMIN_REALM} if refused.status == 401 else None
    return Reject(refused.status, refused.error, refused.reason, headers)


def unrouted(method: str, path: str, allow: Iterable[str] = ()) -> web.Response:
    """404 ``not_found`` (no route has ``path``), or with ``allow`` (the methods the
    path's routes take) 405 ``method_not_allowed`` with its ``Allow`` header; in the
    shape of the front ``path`` belongs to."""
    said = f"{method} {path[:_PATH_SAID]}"
    methods = sorted(allow)
    if methods:
        status, code = 405, Refusal.METHOD_NOT_ALLOWED
        reason = f"{said}: this path takes {', '.join(methods)}"
        headers: dict[str, str] | None = {hdrs.ALLOW: ",".join(methods)}
    else:
        status, code, reason, headers = 404, Refusal.NOT_FOUND, f"no route for {said}", None
    if front_of(path) in OPENAI_SHAPED:
        return openai_refusal(status, reason, code=code.value, headers=headers)
    return refusal(status, code, reason, headers)
