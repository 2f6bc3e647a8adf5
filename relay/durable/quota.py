"""A Durable Stream write under the byte bounds: the stream's own (``--durable-max-stream-bytes``,
the store's rule, 413) and the kit's budgets per token and per client address
(:mod:`relay.service.budget`: ``--durable-token-bytes``, ``--durable-address-bytes`` per
``--durable-budget-window-s``, 429 with ``Retry-After``, 413 for a write larger than a
budget). A write the store refuses (or a ``PUT`` of a stream that exists) is given back.

Order of use: ``result = await quota.write(durable_budget, streams, ref, w, messages, grant)``
in place of ``store.write`` (raises :class:`relay.durable.auth.Refused`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from relay.broker.port import StreamStore, charge
from relay.durable import store
from relay.durable.auth import Grant, Refused
from relay.service.budget import ByteBudgets
from relay.service.errors import Reject

__all__ = ["Quota", "write"]


@dataclass(frozen=True)
class Quota:
    """The bounds of a relay's stream writes (from its flags)."""

    max_stream_bytes: int
    budgets: ByteBudgets


def _stored(w: store.Write, r: store.WriteResult) -> bool:
    """Whether the store kept the write's messages (a PUT answered 200 met its stream)."""
    return r.code < 300 and not (w.op == "put" and r.code == 200)


async def write(
    quota: Quota,
    streams: StreamStore,
    ref: store.StreamRef,
    w: store.Write,
    messages: list[bytes],
    grant: Grant,
) -> store.WriteResult:
    """``store.write`` with the bounds; :class:`Refused` 413 / 429 past one."""
    n = charge(messages)
    charged = None
    if messages:
        try:
            charged = await quota.budgets.charge(streams, grant.address, grant.identity, n)
        except Reject as r:
            raise Refused(r.status, r.reason, r.headers) from None
    w = replace(w, max_bytes=quota.max_stream_bytes)
    try:
        result = await store.write(streams, ref, w, messages)
    except BaseException:
        if charged is not None:
            await quota.budgets.refund(streams, charged)
        raise
    if charged is not None and not _stored(w, result):
        await quota.budgets.refund(streams, charged)
    if result.code == 413:
        rule = "(--durable-max-stream-bytes; each message counts its bytes + 16)"
        if w.fork:  # its copy, a page at a time (relay.durable.fork.create)
            raise Refused(
                413, f"the fork would hold more than the {result.b} bytes a stream may hold {rule}"
            )
        held = f"the stream holds {result.a} bytes; " if result.a else ""
        raise Refused(
            413,
            f"{held}this write of {n} bytes would pass the {result.b} bytes a stream may "
            f"hold {rule}",
        )
    return result
