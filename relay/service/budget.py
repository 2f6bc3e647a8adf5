"""Byte budgets: how many bytes one token and one client address may make the store hold,
for every front that stores what its clients send (the Durable Streams writes).

A budget is a sliding window of bytes counted in the store (``StreamStore.take_bytes``:
one small hash per token and per address, on its own slot), so every relay counts the
same bytes and a client spread over N relays gets no N-fold share: the rule the worker's
live-session cap keeps with its per-address set. A write is charged before the store
takes it (:func:`relay.broker.streams.charge`: its messages' bytes and the store's
overhead per message); a write the store then refuses is given back (:meth:`refund`).
A charge that does not fit is a :class:`relay.service.errors.Reject`: 429 ``byte_budget``
with ``Retry-After`` (when enough of the window's bytes stop counting), or 413
``byte_budget`` when the write alone is larger than the budget. A budget of 0 is off;
with no token (an open path) only the address is charged.

What a stream itself may hold is the store's rule (``StreamWrite.max_bytes``, 413
``stream_full``): one token opens one stream, so that bound is what one token can make
the store hold at once, and the token's budget bounds how fast it may delete and write
again.

Order of use::

    budgets = ByteBudgets(per_token=32 << 20, per_address=64 << 20, window_s=86_400)
    charged = await budgets.charge(store, address, token_id, n)   # raises Reject
    ...write...; if refused: await budgets.refund(store, charged)
"""

from __future__ import annotations

from dataclasses import dataclass

from relay.broker.streams import StreamStore
from relay.protocol.codes import Refusal
from relay.protocol.keys import address_bytes_key, token_bytes_key
from relay.service.errors import Reject, retry_after

__all__ = ["ByteBudgets", "Charged"]


@dataclass(frozen=True, slots=True)
class Charged:
    """What one write was charged, under which keys (given back by :meth:`ByteBudgets.refund`)."""

    keys: tuple[str, ...]
    n: int


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"


class ByteBudgets:
    """Per-token and per-address byte windows (see the module docstring)."""

    def __init__(self, *, per_token: int, per_address: int, window_s: int) -> None:
        if per_token < 0 or per_address < 0 or window_s < 1:
            raise ValueError("need per_token >= 0, per_address >= 0, window_s >= 1")
        self.per_token, self.per_address, self.window_s = per_token, per_address, window_s

    async def charge(self, store: StreamStore, address: str, token: str | None, n: int) -> Charged:
        """Count ``n`` bytes against ``token`` (its stable identity, None: no token) and
        ``address``; :class:`Reject` 429 / 413 ``byte_budget`` when either is spent (the
        other is given back). The store's errors surface as RelayError."""
        taken: list[str] = []
        window_ms = self.window_s * 1000
        budgets = []
        if token is not None and self.per_token > 0:
            budgets.append((token_bytes_key(token), self.per_token, "this token"))
        if self.per_address > 0:
            budgets.append((address_bytes_key(address), self.per_address, "this client address"))
        for key, limit, who in budgets:
            wait_ms = await store.take_bytes(key, n, limit, window_ms)
            if wait_ms:
                await self.refund(store, Charged(tuple(taken), n))
                raise self._refused(who, limit, n, wait_ms)
            taken.append(key)
        return Charged(tuple(taken), n)

    async def refund(self, store: StreamStore, charged: Charged) -> None:
        """Give back what a write the store refused was charged."""
        for key in charged.keys:
            await store.take_bytes(key, -charged.n, 0, self.window_s * 1000)

    def _refused(self, who: str, limit: int, n: int, wait_ms: int) -> Reject:
        said = f"{who} may write {_mib(limit)} per {self.window_s} s"
        if wait_ms < 0:
            return Reject(413, Refusal.BYTE_BUDGET, f"a write of {n} bytes is more than {said}")
        return Reject(
            429, Refusal.BYTE_BUDGET,
            f"{said}; its budget is spent: retry when older writes stop counting",
            retry_after(wait_ms / 1000),
        )  # fmt: skip
