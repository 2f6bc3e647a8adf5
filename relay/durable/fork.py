"""Forks (``PUT`` with ``Stream-Forked-From``): copy-on-fork. The source's messages up to
the fork point (and a ``Stream-Fork-Sub-Offset`` past it: bytes of the next message, or
JSON messages) are read and written into the fork's own log, at the same offsets, in the
fork's creating Lua call; the fork is then a stream like any other, on its own slot, and
its reads, appends and live tail never touch the source's. The source records the fork
(its reference, ``lua/fork_ref.lua``) so that deleting it while forked soft-deletes it
(410, path blocked), and the last fork's delete removes it (and so up the chain).

Order of use: ``write, messages, source = await plan(streams, request_write, headers, body)``
then ``store.write`` and, on 201, ``store.fork_ref``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Final

from relay.broker.port import StreamStore
from relay.durable import core, store
from relay.durable.auth import Refused
from relay.durable.core import BadRequest

__all__ = ["ROOT", "plan", "source_path"]

ROOT: Final = "/v1/stream/"
_DECIMAL: Final = re.compile(r"0|[1-9][0-9]*")
_MAX_FORK_MESSAGES: Final = 100_000


def source_path(value: str) -> str:
    """The source stream's path from ``Stream-Forked-From`` (a URL path on this server)."""
    path = value.strip()
    if path.startswith(ROOT):
        path = path[len(ROOT) :]
    core.stream_id(path)  # BadRequest when malformed
    return path


def sub_offset(value: str | None) -> int:
    if value is None:
        return 0
    if _DECIMAL.fullmatch(value.strip()) is None:
        raise BadRequest("Stream-Fork-Sub-Offset must be a non-negative decimal integer")
    return int(value)


async def plan(
    streams: StreamStore, w: store.Write, headers: Mapping[str, str], own: list[bytes]
) -> tuple[store.Write, list[bytes], store.StreamRef]:
    """The fork's create (its configuration, inherited where the request says nothing)
    and its first messages; raises BadRequest / Refused for what the spec refuses."""
    src = store.StreamRef.of(source_path(headers["Stream-Forked-From"]))
    k = sub_offset(headers.get("Stream-Fork-Sub-Offset"))
    at_text = headers.get("Stream-Fork-Offset")
    if k and at_text is None:
        raise BadRequest("Stream-Fork-Sub-Offset > 0 needs Stream-Fork-Offset")
    try:
        view = await store.read(streams, src, 0, count=_MAX_FORK_MESSAGES, touch=False)
    except store.SoftDeleted:
        raise Refused(409, "the source stream is deleted (its forks still hold it)") from None
    if view is None:
        raise Refused(404, "no such source stream")
    if view.next > len(view.messages):
        raise Refused(413, f"a source of more than {_MAX_FORK_MESSAGES} messages is not forked")
    at = view.next
    if at_text is not None:
        parsed = core.parse_offset(at_text)
        at = view.next if parsed is None else parsed
    if at > view.next:
        raise BadRequest("Stream-Fork-Offset is past the source's tail")
    inherited = view.messages[:at]
    if k:
        if view.json_mode:
            if at + k > view.next:
                raise BadRequest("Stream-Fork-Sub-Offset is past the source's messages")
            inherited = view.messages[: at + k]
        else:
            if at >= view.next or k > len(view.messages[at]):
                raise BadRequest("Stream-Fork-Sub-Offset is past the message at the fork offset")
            inherited = [*inherited, view.messages[at][:k]]
    if headers.get("Content-Type") and w.media_type != view.media_type:
        raise Refused(409, "the fork's Content-Type differs from the source's")
    ttl, expires = w.ttl, w.expires_at
    if ttl is None and expires is None:
        ttl = view.ttl
        expires = core.parse_expires_at(view.expires_at) if view.expires_at else None
    fork = replace(
        w, media_type=view.media_type, content_type=view.content_type, ttl=ttl,
        expires_at=expires, fork=f"{src.path}\n{at}\n{k}",
    )  # fmt: skip
    if own and view.json_mode != (fork.media_type == "application/json"):
        raise BadRequest("the body does not fit the source's content type")
    return fork, inherited + own, src
