"""The Python producer API behind the conformance command protocol.

One JSON object per line on stdin, one answer per line on stdout (docs/PROTOCOL.md,
"Producer conformance"). Commands: ``start`` {session, message, meta?, watch?: the
turn refreshes its lock and counts its viewers, as a product's turn does}, ``write``
{text}, ``part`` {part, id, phase?, name?, summary?, text?, value?, error?}, ``pipe``
{items: a stream's items, JSON arrays standing for LangGraph's (chunk, metadata) pairs:
``pipe`` tells the kind from the first item and ends the turn}, ``done``
{finish_reason?, usage?}, ``error`` {reason}, ``replay_last`` (send
the last publish again with the same bytes and expected offset, as a retry after a
lost reply does), ``quit``. Answers: ``{"ok": true, ...}`` or ``{"ok": false,
"error": <code>, "message": <line>}``; codes: invalid_session, frame_too_large,
turn_closed, redis_unreachable, stale_epoch, turn_busy, lock_lost, invalid_part.

Settings from the environment: ``TR_REDIS_URL``, ``TR_LOCK_TTL_S`` (unset: the
producer's default), ``TR_MAXLEN``,
``TR_COALESCE`` (max deltas per frame; 1: none).

Run: ``python -m tests.conformance.py_producer``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from typing import Any

from relay.broker.rediscluster.publisher import Generation
from relay.producer import (
    CoalescePolicy,
    FrameTooLarge,
    InvalidSession,
    LockLost,
    PartError,
    Producer,
    ProducerError,
    RedisUnreachable,
    StaleEpoch,
    Turn,
    TurnBusy,
    TurnClosed,
    Usage,
    pipe,
)

CODES: list[tuple[type[ProducerError], str]] = [
    (InvalidSession, "invalid_session"),
    (FrameTooLarge, "frame_too_large"),
    (TurnClosed, "turn_closed"),
    (RedisUnreachable, "redis_unreachable"),
    (StaleEpoch, "stale_epoch"),
    (TurnBusy, "turn_busy"),
    (LockLost, "lock_lost"),
]


def code_of(exc: BaseException) -> str:
    return next((c for t, c in CODES if isinstance(exc, t)), "internal")


async def handle(p: Producer, state: dict[str, Any], cmd: dict[str, Any]) -> dict[str, Any]:
    op = cmd.get("op")
    turn: Turn | None = state.get("turn")
    if op == "start":
        s = p.session(str(cmd["session"]))
        t = await s.start_turn(str(cmd.get("message", "")), meta=cmd.get("meta"),
                               watch=bool(cmd.get("watch")))  # fmt: skip
        state["turn"] = t
        return {"ok": True, "turn": t.turn, "offset": t.first_offset, "epoch": t.epoch}
    if turn is None:
        return {"ok": False, "error": "no_turn", "message": "start a turn first"}
    if op == "write":
        turn.write(str(cmd["text"]))
        return {"ok": True}
    if op == "part":  # one part frame: phase start, delta, end, or a whole part (no phase)
        part, pid, phase = str(cmd["part"]), str(cmd["id"]), cmd.get("phase")
        if phase == "start":
            turn.part_start(part, pid, name=str(cmd.get("name", "")),
                            summary=bool(cmd.get("summary")))  # fmt: skip
        elif phase == "delta":
            turn.part_delta(part, pid, str(cmd["text"]))
        elif phase == "end":
            turn.part_end(part, pid)
        else:
            turn.part(part, pid, cmd.get("value"), name=str(cmd.get("name", "")),
                      error=bool(cmd.get("error")))  # fmt: skip
        return {"ok": True}
    if op == "pipe":
        items = [tuple(x) if isinstance(x, list) else x for x in cmd["items"]]

        async def source() -> AsyncIterator[Any]:
            for x in items:
                yield x

        return {"ok": True, "offset": await pipe(turn, source())}
    if op == "done":
        u = cmd.get("usage")
        usage = Usage(**u) if isinstance(u, dict) else None
        at = await turn.done(finish_reason=cmd.get("finish_reason", "stop"), usage=usage)
        return {"ok": True, "offset": at}
    if op == "error":
        return {"ok": True, "offset": await turn.error(str(cmd["reason"]))}
    if op == "replay_last":
        g = turn.generation
        assert isinstance(g, Generation)  # a producer on Redis: the publisher's generation
        last = g.offset
        data = g._written[last]  # the bytes of the last frame written, resent as they were
        got = await g._write(last - 1, [data], False)
        return {"ok": True, "offset": got}
    return {"ok": False, "error": "unknown_op", "message": f"unknown op {op!r}"}


async def main() -> None:
    env = os.environ
    p = await Producer.connect(
        env.get("TR_REDIS_URL", "redis://127.0.0.1:7000"),
        producer_id="conformance-py",
        **({"lock_ttl_s": float(env["TR_LOCK_TTL_S"])} if env.get("TR_LOCK_TTL_S") else {}),
        maxlen=int(env.get("TR_MAXLEN", "10000")),
        coalesce=CoalescePolicy(max_tokens=int(env.get("TR_COALESCE", "8"))),
    )
    state: dict[str, Any] = {}
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=4 * 1024 * 1024)  # a delta over the frame limit
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"ok": True, "ready": "python"}), flush=True)
    try:
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd.get("op") == "quit":
                break
            try:
                out = await handle(p, state, cmd)
            except ProducerError as exc:
                out = {"ok": False, "error": code_of(exc), "message": str(exc)}
            except PartError as exc:
                out = {"ok": False, "error": "invalid_part", "message": str(exc)}
            print(json.dumps(out), flush=True)
    finally:
        await p.aclose()


if __name__ == "__main__":
    asyncio.run(main())
