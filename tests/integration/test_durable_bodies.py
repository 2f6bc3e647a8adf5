"""relay.durable.bodies: a JSON body over 4 KiB is parsed in a process of the relay's own
(its refusals cross back whole), at most MAX_PENDING wait for it (503 past them), and a
process that died answers 503 once and is replaced."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from relay.durable.auth import Refused
from relay.durable.bodies import MAX_PENDING, ON_LOOP_BYTES, Parser
from relay.durable.core import BadRequest, TooLarge

pytestmark = pytest.mark.integration

BIG = json.dumps(list(range(5000))).encode()


async def test_large_bodies_are_parsed_in_their_own_process() -> None:
    parser = Parser()
    try:
        assert len(BIG) > ON_LOOP_BYTES
        got = await parser.messages(BIG, True, allow_empty_array=False)
        assert got == [str(i).encode() for i in range(5000)]
        assert parser.off_loop == 1
        assert await parser.messages(b"[1,2]", True, allow_empty_array=False) == [b"1", b"2"]
        assert parser.off_loop == 1  # small: on the loop
        with pytest.raises(TooLarge) as big:
            await parser.messages(b"[" + b"0," * 20_000 + b"0]", True, allow_empty_array=False)
        assert big.value.status == 413
        with pytest.raises(BadRequest, match="surrogate") as bad:
            await parser.messages(b'["\\ud800"' + b" " * ON_LOOP_BYTES + b"]", True,
                                  allow_empty_array=False)  # fmt: skip
        assert bad.value.status == 400
        waiting = [
            asyncio.create_task(parser.messages(BIG, True, allow_empty_array=False))
            for _ in range(MAX_PENDING)
        ]
        await asyncio.sleep(0)
        with pytest.raises(Refused) as busy:
            await parser.messages(BIG, True, allow_empty_array=False)
        assert (busy.value.status, busy.value.headers) == (503, {"Retry-After": "1"})
        assert all(len(m) == 5000 for m in await asyncio.gather(*waiting))
        pool = parser._pool
        assert pool is not None
        for pid in list(pool._processes):  # our own child
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(Refused) as died:
            await parser.messages(BIG, True, allow_empty_array=False)
        assert died.value.status == 503
        assert len(await parser.messages(BIG, True, allow_empty_array=False)) == 5000
    finally:
        parser.close()
