"""The frames of a session that are outside its order: offset 0, never a duplicate or a
gap, never a resume point.

- **The deleted notice** (:func:`relay.protocol.frame.deleted_frame`: a ``reset`` with
  ``meta.code`` ``session_deleted``): the producer that deleted a session SPUBLISHes it;
  the hub recognises it (:func:`is_deleted`) and ends the session's streams with it
  (:meth:`relay.edge.fanout.hub.Hub._gone`); a relay that learns the deletion from a read
  instead makes its own (:func:`deleted_delivery`).

Order of use: the hub calls :func:`is_deleted` on a live frame that is not its channel's
next one, and :func:`deleted_delivery` when a read raised
:class:`relay.broker.errors.SessionDeleted`.
"""

from __future__ import annotations

from typing import Final

from relay.edge.core.resume import Delivery
from relay.protocol.codes import CloseCode
from relay.protocol.frame import Frame, deleted_frame, encode

__all__ = ["DELETED_REASON", "deleted_delivery", "is_deleted"]

DELETED_REASON: Final = "the session was deleted"


def is_deleted(f: Frame) -> bool:
    """The notice of a deleted session (:func:`relay.protocol.frame.deleted_frame`)."""
    return (
        f.kind == "reset" and f.meta is not None and f.meta.get("code") == CloseCode.SESSION_DELETED
    )


def deleted_delivery(sid: str) -> Delivery:
    """The relay's own deleted notice, for a deletion found by a read (the producer's
    notice did not reach this relay)."""
    return Delivery(0, "reset", encode(deleted_frame(sid)))
