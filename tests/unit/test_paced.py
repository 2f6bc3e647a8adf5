"""relay.service.paced.write_paced: a body in bounded slices, each within a deadline; a
client that does not take one is cut (its transport aborted)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from aiohttp import web

from relay.service.paced import SLICE, SlowReader, write_paced


class _Transport:
    aborted = False

    def abort(self) -> None:
        self.aborted = True


class _Request:
    def __init__(self) -> None:
        self.transport = _Transport()


class _Resp:
    def __init__(self, hang_after: int | None = None) -> None:
        self.writes: list[bytes] = []
        self.hang_after = hang_after

    async def write(self, data: Any) -> None:
        if self.hang_after is not None and len(self.writes) >= self.hang_after:
            await asyncio.get_running_loop().create_future()  # a client that stopped reading
        self.writes.append(bytes(data))


async def _run(parts: list[bytes], resp: _Resp, timeout_s: float = 1.0) -> _Request:
    req = _Request()
    await write_paced(cast(web.BaseRequest, req), cast(web.StreamResponse, resp), parts,
                      timeout_s=timeout_s)  # fmt: skip
    return req


async def test_slices_are_bounded_and_small_parts_gathered() -> None:
    big = bytes(range(256)) * (5 * SLICE // 256 + 7)
    parts = [b"["] + [b"1", b","] * 1000 + [big, b"]"]
    resp = _Resp()
    await _run(parts, resp)
    assert b"".join(resp.writes) == b"".join(parts)
    assert max(len(w) for w in resp.writes) <= SLICE
    assert len(resp.writes) <= len(big) // SLICE + 3  # not one write per tiny part


async def test_a_reader_that_does_not_take_a_slice_is_cut() -> None:
    resp = _Resp(hang_after=2)
    req = _Request()
    with pytest.raises(SlowReader):
        await write_paced(cast(web.BaseRequest, req), cast(web.StreamResponse, resp),
                          [b"x" * (10 * SLICE)], timeout_s=0.05)  # fmt: skip
    assert req.transport.aborted
    assert len(resp.writes) == 2
