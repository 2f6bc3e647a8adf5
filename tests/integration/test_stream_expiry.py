"""The stream guard's one expiry timer (no Redis, no sockets, in real time: tokens that
expire a second or two from now): every stream whose token expires is told so once, at
its second, a stream that ended before is not, and nothing stays armed for streams that
are gone.

Streams here are stand-ins that record the kick the guard sends them.
"""

from __future__ import annotations

import asyncio
import time

from relay.edge.http.limits import Access, StreamGuard, token_key
from relay.protocol.auth import Claims
from relay.protocol.codes import CloseCode


class FakeStream:
    """What the guard keeps of a connection: its counted identity, and its kick."""

    def __init__(self) -> None:
        self.kicks: list[CloseCode] = []
        self.kicked = asyncio.Event()
        self.token, self.address, self.expires, self.ticket = 0, "", 0, False

    def kick(self, code: CloseCode, reason: str) -> None:
        self.kicks.append(code)
        self.kicked.set()


def _access(token: str, expires: int) -> Access:
    claims = Claims("s", expires, "watch", jti=token)
    return Access(claims, token_key(claims), "10.0.0.1")


async def test_streams_end_at_their_token_expiry_and_released_ones_do_not() -> None:
    guard = StreamGuard(per_token=0, per_address=0)
    soon = int(time.time()) + 1
    streams = {name: FakeStream() for name in ("a", "b", "gone", "later")}
    due = {"a": soon, "b": soon, "gone": soon, "later": soon + 1}
    for name, stream in streams.items():
        guard.admit(stream, _access(name, due[name]))
        guard.bind(stream)
    assert guard.armed == 4
    guard.release(streams["gone"])  # its stream ended before its token expired
    assert guard.armed == 3
    async with asyncio.timeout(10):
        for name in ("a", "b", "later"):
            await streams[name].kicked.wait()
    for name in ("a", "b", "later"):
        assert streams[name].kicks == [CloseCode.TOKEN_EXPIRED]
    assert streams["gone"].kicks == []
    assert guard.armed == 0
    for stream in streams.values():
        guard.release(stream)  # what end_stream does when the kicked stream ends
    assert not guard.by_address
    assert not guard.by_token


async def test_an_earlier_expiry_rearms_the_timer_and_churn_leaves_nothing_armed() -> None:
    guard = StreamGuard(per_token=0, per_address=0)
    now = int(time.time())
    late = FakeStream()
    guard.admit(late, _access("late", now + 3600))
    guard.bind(late)
    for i in range(1_000):  # streams that open and close long before their expiry
        s = FakeStream()
        guard.admit(s, _access(f"c{i}", now + 60 + i % 7))
        guard.bind(s)
        guard.release(s)
    assert guard.armed == 1
    early = FakeStream()
    guard.admit(early, _access("early", now + 1))
    guard.bind(early)
    async with asyncio.timeout(10):
        await early.kicked.wait()
    assert late.kicks == []
    assert guard.armed == 1
