"""The one JSON-body rule of every HTTP front, pure: what a body must be to be read.

A body is JSON (else 400 ``malformed_json``), nested at most :data:`MAX_DEPTH` deep
(else 400 ``malformed_json``: nothing past the reader walks a deeper one, and no
parser's recursion limit becomes a traceback) and, where the route asks for one, a JSON
object (else 400 ``invalid_body``). Each refusal is a :class:`BodyRefused`: a status, a
:class:`relay.protocol.codes.Refusal` and a sentence, which each front answers in its
own convention (:mod:`relay.service.httpbody`, which also reads the body with its
bound: 413, 415).

Order of use: ``value = parse_json(raw)`` (or ``read_json(request, max_bytes)`` in
:mod:`relay.service.httpbody`, which calls it); ``except BodyRefused``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import orjson

from relay.protocol.codes import Refusal

__all__ = ["ANY_BODY", "JSON", "MAX_DEPTH", "BodyRefused", "ClientGone", "parse_json"]

JSON: Final = "application/json"
MAX_DEPTH: Final = 256  # arrays and objects inside each other; no API of ours nests 10
_REASON_CHARS: Final = 160
ANY_BODY: Final[Any] = object()  # parse_json's default: an empty body is malformed JSON


class BodyRefused(Exception):
    """A request body a front does not read: ``status`` (400, 413, 415), ``code`` and a
    ``reason`` for people."""

    def __init__(self, status: int, code: Refusal, reason: str) -> None:
        super().__init__(f"{status} {code}: {reason}")
        self.status, self.code, self.reason = status, code, reason


class ClientGone(BodyRefused):
    """The client left before its body was in: nobody reads an answer."""

    def __init__(self) -> None:
        super().__init__(400, Refusal.MALFORMED_JSON, "the client left mid-body")


def _too_deep(value: Any, max_depth: int) -> bool:
    """Whether ``value`` nests arrays / objects past ``max_depth``: level by level, an
    empty container counted at its level and never walked (a body of a million ``{}``
    is one pass, not a million)."""
    level = [value] if isinstance(value, (dict, list)) and value else []
    depth = 1
    while level:
        inner = [x for v in level for x in (v.values() if isinstance(v, dict) else v)
                 if isinstance(x, (dict, list))]  # fmt: skip
        if not inner:
            return False
        depth += 1
        if depth > max_depth:
            return True
        level = [x for x in inner if x]
    return False


def parse_json(
    raw: bytes,
    *,
    want_object: bool = True,
    empty: Any = ANY_BODY,
    max_depth: int = MAX_DEPTH,
    loads: Callable[[bytes], Any] = orjson.loads,
) -> Any:
    """``raw`` parsed, or :class:`BodyRefused` (400): not JSON (``malformed_json``),
    nested past ``max_depth`` (``malformed_json``), not an object when ``want_object``
    (``invalid_body``). ``empty``: what a blank body stands for (default: malformed);
    ``loads``: the parser (orjson; :func:`json.loads` where arbitrary-precision numbers
    must survive)."""
    if empty is not ANY_BODY and not raw.strip():
        return empty
    try:
        value = loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # orjson's is a ValueError
        reason = f"body is not valid JSON: {exc}"[:_REASON_CHARS]
        raise BodyRefused(400, Refusal.MALFORMED_JSON, reason) from None
    if raw.count(b"[") + raw.count(b"{") > max_depth and _too_deep(value, max_depth):
        reason = f"body is nested more than {max_depth} levels deep"
        raise BodyRefused(400, Refusal.MALFORMED_JSON, reason)
    if want_object and not isinstance(value, dict):
        raise BodyRefused(400, Refusal.INVALID_BODY, "body must be a JSON object")
    return value
