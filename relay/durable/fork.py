"""Forks (``PUT`` with ``Stream-Forked-From``): copy-on-fork. The source's messages up to
the fork point (and a ``Stream-Fork-Sub-Offset`` past it: bytes of the next message, or
JSON messages) are copied into the fork's own log, at the same offsets; the fork is then
a stream like any other, on its own slot, and its reads, appends and live tail never
touch the source's, nor does it need the source's data once made. The source records the
fork (its reference, ``lua/fork_ref.lua``) so that deleting it while forked soft-deletes
it (410, path blocked: the protocol's rule; its data is removed), and the last fork's
delete removes it (and so up the chain).

A fork needs read access to its source: :mod:`relay.durable.http` checks a token of the
source (``Stream-Forked-From-Token``, or the request's own) before :func:`plan` reads it.

The copy is made in bounded steps: the source is read in pages of at most
:data:`PAGE_MESSAGES` messages and :data:`PAGE_BYTES` bytes, each page one Redis call on
the source's master and one on the fork's (``build`` steps of a stream nobody sees yet,
``lua/write.lua``), then the create commits them with the request's own messages. No
call holds a master for longer than a page takes; a source deleted or re-created during
the copy fails the fork (409); a copy left half-way (the relay died) expires within
seconds and was never visible.

Order of use: ``p = await plan(streams, request_write, headers, own)``, then
``result = await create(streams, ref, p, write)`` and, on 201, ``store.fork_ref``.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Final

from relay.broker.port import StreamStore
from relay.durable import core, store
from relay.durable.auth import Refused
from relay.durable.core import BadRequest

__all__ = ["MAX_FORK_MESSAGES", "PAGE_BYTES", "PAGE_MESSAGES", "Plan", "Writer", "create",
           "plan", "source_path"]  # fmt: skip

ROOT: Final = "/v1/stream/"
_DECIMAL: Final = re.compile(r"0|[1-9][0-9]*")
MAX_FORK_MESSAGES: Final = 100_000
PAGE_MESSAGES: Final = 1000
PAGE_BYTES: Final = 1 << 20
_RETRY: Final = {"Retry-After": "1"}


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


@dataclass(frozen=True)
class Plan:
    """A fork's create: its write, its source (at incarnation ``gen``), the source's
    messages ``[0, upto)`` it copies, then ``tail`` (a byte sub-offset's part of the next
    message, and the request's own messages)."""

    write: store.Write
    source: store.StreamRef
    gen: str
    upto: int
    tail: list[bytes]


async def _source(streams: StreamStore, src: store.StreamRef, at: int, count: int) -> store.View:
    try:
        view = await store.read(streams, src, at, count=count, touch=False, max_bytes=PAGE_BYTES)
    except store.SoftDeleted:
        raise Refused(409, "the source stream is deleted (its forks still hold it)") from None
    if view is None:
        raise Refused(404, "no such source stream")
    return view


async def plan(
    streams: StreamStore, w: store.Write, headers: Mapping[str, str], own: list[bytes]
) -> Plan:
    """The fork's create (its configuration, inherited where the request says nothing);
    reads the source's state only. Raises BadRequest / Refused for what the spec refuses."""
    src = store.StreamRef.of(source_path(headers["Stream-Forked-From"]))
    k = sub_offset(headers.get("Stream-Fork-Sub-Offset"))
    at_text = headers.get("Stream-Fork-Offset")
    if k and at_text is None:
        raise BadRequest("Stream-Fork-Sub-Offset > 0 needs Stream-Fork-Offset")
    view = await _source(streams, src, 0, 0)
    if view.next > MAX_FORK_MESSAGES:
        raise core.TooLarge(f"a source of more than {MAX_FORK_MESSAGES} messages is not forked")
    at = view.next
    if at_text is not None:
        parsed = core.parse_offset(at_text)
        at = view.next if parsed is None else parsed
    if at > view.next:
        raise BadRequest("Stream-Fork-Offset is past the source's tail")
    upto, tail = at, list(own)
    if k:
        if view.json_mode:
            if at + k > view.next:
                raise BadRequest("Stream-Fork-Sub-Offset is past the source's messages")
            upto = at + k
        else:
            nxt = await _source(streams, src, at, 1) if at < view.next else None
            if nxt is None or not nxt.messages or k > len(nxt.messages[0]):
                raise BadRequest("Stream-Fork-Sub-Offset is past the message at the fork offset")
            tail = [nxt.messages[0][:k], *own]
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
    return Plan(fork, src, view.gen, upto, tail)


async def _page(streams: StreamStore, p: Plan, at: int) -> list[bytes]:
    """The source's messages from ``at``: one bounded read, of the planned incarnation."""
    if at >= p.upto:
        return []
    view = await _source(streams, p.source, at, min(PAGE_MESSAGES, p.upto - at))
    if view.gen != p.gen or not view.messages:
        raise Refused(409, "the source stream was deleted or re-created during the fork")
    return view.messages


Writer = Callable[[store.Write, list[bytes]], Awaitable[store.WriteResult]]


async def create(
    streams: StreamStore, ref: store.StreamRef, p: Plan, write: Writer
) -> store.WriteResult:
    """Copy the source's messages and create the fork: one call when they fit one page,
    else ``build`` steps of a page each and the commit (see the module docstring). Every
    call is ``write(w, messages)`` on ``ref`` (the relay's: :func:`relay.durable.quota.write`,
    so the copy counts against the byte bounds as any write does; 413 stops it)."""
    page = await _page(streams, p, 0)
    if len(page) >= p.upto:
        return await write(p.write, page + p.tail)
    step = replace(p.write, op="build", build=secrets.token_hex(8))
    copied = 0
    while page:
        r = await write(step, page)
        if r.code == 413:  # past the stream's byte bound: the build expires unseen
            return r
        if r.code != 202:  # the path exists (or another create holds it): the PUT's answer
            return await write(p.write, p.tail)
        copied += len(page)
        page = await _page(streams, p, copied)
    r = await write(replace(p.write, build=step.build), p.tail)
    if r.code == 412:  # the build expired between two steps: nothing is visible
        raise Refused(503, "the fork's copy did not finish in time: try again", _RETRY)
    return r
