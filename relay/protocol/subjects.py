"""What a token names: a session or a Durable Stream, and the one namespace rule.

Pure (standard library and :mod:`relay.protocol.keys` only).

A token's ``sub`` is a session id (``[A-Za-z0-9_-]{1,64}``) or a stream's subject,
:func:`stream_subject`: ``ds:<stream id>``. The two namespaces are disjoint by their
spelling (a session id never holds a colon), and :func:`namespace_refusal` is the rule
:func:`relay.protocol.auth.verify_token` applies to every token: a session's token never
opens a stream and a stream's token never opens a session, whatever the ids look like
(an application may name a session ``ds_<anything>``: it still opens no stream).

Order of use: ``sub = stream_subject(stream_id)`` to mint a stream's token;
``parse_subject(claims["sub"])`` then ``namespace_refusal(sub, wanted)`` to verify one.
"""

from __future__ import annotations

import re
from typing import Final

from relay.protocol.keys import parse_session

__all__ = [
    "STREAM_PREFIX",
    "is_stream_subject",
    "namespace_refusal",
    "parse_subject",
    "stream_subject",
]

STREAM_PREFIX: Final = "ds:"  # a stream's subject; never a session id (no colon there)
_STREAM_ID: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")


def stream_subject(stream_id: str) -> str:
    """The ``sub`` of a token for the Durable Stream ``stream_id`` (the hash tag
    :func:`relay.durable.core.stream_id` makes of its path): ``ds:<stream id>``."""
    if _STREAM_ID.fullmatch(stream_id) is None:
        raise ValueError("a stream id is 1-64 characters of [A-Za-z0-9_-]")
    return STREAM_PREFIX + stream_id


def is_stream_subject(subject: str) -> bool:
    """Whether ``subject`` names a stream (:func:`stream_subject`), not a session."""
    return subject.startswith(STREAM_PREFIX)


def parse_subject(subject: object) -> str:
    """``subject`` if it is a session id or a stream's subject, else ``ValueError``
    (:class:`relay.protocol.keys.InvalidSessionId` for a bad session id)."""
    if isinstance(subject, str) and is_stream_subject(subject):
        if _STREAM_ID.fullmatch(subject[len(STREAM_PREFIX) :]) is None:
            raise ValueError("a stream subject is ds: and 1-64 characters of [A-Za-z0-9_-]")
        return subject
    return parse_session(subject)


def namespace_refusal(token_subject: str, wanted: str) -> str | None:
    """None when a token of ``token_subject`` is of the kind ``wanted`` asks for (a
    session's for a session, a stream's for a stream), else why not (the rule)."""
    wants_stream = is_stream_subject(wanted)
    if is_stream_subject(token_subject) == wants_stream:
        return None
    if wants_stream:
        return "a session's token does not open a stream"
    return "a stream's token does not open a session"
