"""The one bounded JSON-body reader of every HTTP front (the relay's and the worker's),
and the answer to a body it refuses in each front's convention.

What every route that takes a body does first, written once: the media type (415
unless ``application/json``, where the route asks for it), the size (413 when
``Content-Length`` is over the bound or more bytes than it arrive: never more than the
bound is held in memory), then the JSON rule of :mod:`relay.service.jsonbody` (400).
A refusal is a :class:`relay.service.jsonbody.BodyRefused`; a front answers it with
:func:`refused` (the own wire's ``{"error", "reason"}``,
:func:`relay.service.errors.refusal`) or :func:`refused_openai` (OpenAI's ``{"error":
{"message", "type", "code"}}``, :func:`relay.service.errors.openai_refusal`); a client
that left mid-body (:class:`relay.service.jsonbody.ClientGone`) gets
:func:`relay.service.httpguard.client_gone` in both.

Order of use::

    try:
        body = await read_json(request, cfg.max_body_bytes)        # a dict
    except BodyRefused as r:
        return refused(r)                                          # or refused_openai(r)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from aiohttp import web

from relay.protocol.codes import Refusal
from relay.service.errors import openai_refusal, refusal
from relay.service.httpguard import client_gone
from relay.service.jsonbody import ANY_BODY, JSON, BodyRefused, ClientGone, parse_json

__all__ = ["read_body", "read_json", "refused", "refused_openai"]

_CHUNK: Final = 64 * 1024


async def read_body(
    request: web.BaseRequest, max_bytes: int, *, content_type: str | None = JSON
) -> bytes:
    """The request's body, at most ``max_bytes`` (413 past it, from ``Content-Length``
    or while it arrives); ``content_type``: the media type it must have (415), None for
    any. Raises :class:`BodyRefused`, :class:`ClientGone`."""
    if content_type is not None and request.content_type != content_type:
        raise BodyRefused(415, Refusal.UNSUPPORTED_MEDIA_TYPE, f"send the body as {content_type}")
    too_large = BodyRefused(413, Refusal.BODY_TOO_LARGE, f"body larger than {max_bytes} bytes")
    if request.content_length is not None and request.content_length > max_bytes:
        raise too_large
    parts: list[bytes] = []
    size = 0
    try:
        while chunk := await request.content.read(_CHUNK):
            size += len(chunk)
            if size > max_bytes:
                raise too_large
            parts.append(chunk)
    except ConnectionResetError:  # aiohttp's mark of a body whose client left
        raise ClientGone() from None
    return b"".join(parts)


async def read_json(
    request: web.BaseRequest,
    max_bytes: int,
    *,
    content_type: str | None = JSON,
    want_object: bool = True,
    empty: Any = ANY_BODY,
) -> Any:
    """:func:`read_body`, then :func:`relay.service.jsonbody.parse_json` (see both)."""
    raw = await read_body(request, max_bytes, content_type=content_type)
    return parse_json(raw, want_object=want_object, empty=empty)


def refused(r: BodyRefused, headers: Mapping[str, str] | None = None) -> web.Response:
    """The own wire's answer: ``{"error": code, "reason": sentence}``."""
    if isinstance(r, ClientGone):
        return client_gone()
    return refusal(r.status, r.code, r.reason, headers)


def refused_openai(r: BodyRefused, headers: Mapping[str, str] | None = None) -> web.Response:
    """OpenAI's answer: ``{"error": {"message", "type", "param", "code"}}``."""
    if isinstance(r, ClientGone):
        return client_gone()
    return openai_refusal(r.status, r.reason, code=r.code, headers=headers)
