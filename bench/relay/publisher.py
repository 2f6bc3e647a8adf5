"""The publisher of the relay benchmarks, as a child process (so that its CPU is its own).

``python -m bench.relay.publisher SPEC.json`` reads a spec and prints one JSON line
(``sent``, ``seconds``, ``cpu_s``, ``errors``...); :func:`bench.relay.harness.run_publisher`
starts it and reads that line from its log. Two modes:

- ``flood``: ``frames`` token frames per session through :class:`Generation.publish`,
  ``batch`` frames per call of the publish script (XADD backlog + SPUBLISH in one call);
- ``paced``: ``rate`` token frames/s per session for ``seconds``, one frame per call,
  pipelined per master on raw connections; every ``tick_s`` (default 10 ms) the tick's
  share of the sessions, in one write per master.

Every token's text is the producer's clock (``<19-digit ns>;``), which the clients
count and turn into latency (:data:`bench.relay.harness.STAMP`). Flooded frames are
stamped when made. Paced frames by default (``stamp: "send"``) when their tick's write
is handed to the socket: they are made first with a placeholder of the same length, so
the time this Python process takes to build a tick's frames is not counted as latency
of the system under test; ``stamp: "build"`` stamps each as it is made (the way
``bench/peers/js/socketio_emit.cjs`` stamps, for a like-for-like comparison with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any, cast

import hiredis

from bench._util import self_cpu_s
from bench.relay.harness import slotmap
from relay.broker.rediscluster.connect import connect
from relay.broker.rediscluster.nodeconn import raw_command
from relay.broker.rediscluster.publisher import Draft, Generation, Publisher
from relay.broker.rediscluster.scripts import PUBLISH
from relay.protocol.frame import Frame, encode
from relay.protocol.keys import live_channel
from relay.protocol.slotmap import Addr, slot_of

__all__ = ["main", "open_generations", "publish_flood", "publish_paced"]


async def publish_flood(url: str, sids: list[str], frames: int, batch: int) -> dict[str, Any]:
    """``frames`` token frames per session through :class:`Generation.publish`."""
    redis = connect(url)
    await redis.initialize()
    try:
        pub = Publisher(redis)
        sem = asyncio.Semaphore(64)
        sent = 0

        async def one(sid: str) -> None:
            nonlocal sent
            async with sem:
                gen = await pub.open_generation(sid)
                left = frames
                while left:
                    k = min(batch, left)
                    drafts = [Draft(kind="token", text=f"{time.time_ns():019d};") for _ in range(k)]
                    await gen.publish(drafts)
                    left -= k
                    sent += k

        t0 = time.perf_counter()
        await asyncio.gather(*(one(s) for s in sids))
        took = time.perf_counter() - t0
    finally:
        await redis.aclose()
    return {"sent": sent, "seconds": took, "errors": 0, "cpu_s": self_cpu_s()}


async def open_generations(url: str, sids: list[str]) -> list[list[Any]]:
    """One :meth:`Publisher.open_generation` per session (a turn's opening), as the
    ``opened`` of :func:`publish_paced`: ``[sid, epoch, turn, offset, gen]`` each."""
    redis = connect(url)
    await redis.initialize()
    try:
        pub = Publisher(redis)
        sem = asyncio.Semaphore(64)

        async def one(sid: str) -> list[Any]:
            async with sem:
                g = await pub.open_generation(sid)
            return [g.session, g.epoch, g.turn, g.offset, g.gen]

        return list(await asyncio.gather(*(one(s) for s in sids)))
    finally:
        await redis.aclose()


_HOLD = "~" * 19  # the stamp's place in a paced frame until its write
_HOLD_BYTES = _HOLD.encode()


async def publish_paced(
    url: str,
    sids: list[str],
    rate: float,
    seconds: float,
    tick: float = 0.01,
    *,
    stamp_at_send: bool = True,
    opened: list[list[Any]] | None = None,
) -> dict[str, Any]:
    """``rate`` token frames/s per session for ``seconds``, one frame per call of the
    publish script (:data:`relay.broker.rediscluster.scripts.PUBLISH`, its argument layout of
    ``Generation._write``), pipelined per master on raw connections: redis-py costs more
    CPU per call than this machine can give to 20,000 calls/s. ``opened``: the sessions'
    generations as :func:`open_generations` returned them (``[sid, epoch, turn, offset,
    gen]`` each), opened by the caller; else this opens one per session first."""
    redis = connect(url)
    pub = Publisher(redis)  # its settings (maxlen, TTL) for the script's arguments
    if opened is not None:  # opened by the caller, outside its measured window
        gens = [Generation(pub, s, int(e), int(t), int(o), str(g)) for s, e, t, o, g in opened]
    else:
        await redis.initialize()
        try:
            gens = list(await asyncio.gather(*(pub.open_generation(s) for s in sids)))
        finally:
            await redis.aclose()
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    smap = await slotmap(Addr(host, int(port)))
    conns: dict[Addr, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
    node_of: list[Addr] = []
    for g in gens:
        node = smap.node_for(slot_of(live_channel(g.session)))
        assert node is not None
        node_of.append(node)
        if node not in conns:
            conns[node] = await asyncio.open_connection(node.host, node.port)
            await raw_command(node, "SCRIPT", "LOAD", PUBLISH.source)
    pending = dict.fromkeys(conns, 0)
    errors: list[str] = []
    replies = 0

    async def read_replies(node: Addr) -> None:
        nonlocal replies
        reader = conns[node][0]
        parser = hiredis.Reader()
        while True:
            chunk = await reader.read(1 << 16)
            if not chunk:
                return
            parser.feed(chunk)
            while (r := parser.gets()) is not False:
                pending[node] -= 1
                replies += 1
                if isinstance(r, hiredis.ReplyError):
                    errors.append(str(r)[:80])

    readers = [asyncio.create_task(read_replies(n)) for n in conns]
    per_tick = rate * tick  # calls per session per tick (0.2 at 20/s)
    groups = max(1, round(1 / per_tick)) if per_tick < 1 else 1
    sent = 0
    cpu0 = self_cpu_s()  # the pacing's own CPU, without start-up and the opens
    t0 = time.perf_counter()
    n_ticks = int(seconds / tick)
    for t in range(n_ticks):
        bufs: dict[Addr, list[bytes]] = {n: [] for n in conns}
        for i in range(t % groups, len(gens), groups):
            g = gens[i]
            off = g.offset + 1
            frame = encode(
                Frame(
                    session=g.session,
                    turn=g.turn,
                    offset=off,
                    kind="token",
                    text=f"{_HOLD if stamp_at_send else f'{time.time_ns():019d}'};",
                    epoch=g.epoch,
                    ts=time.time_ns() // 1_000_000,
                    meta={"gen": g.gen},
                )
            )
            keys, args = g.script_call(g.offset, [frame])
            bufs[node_of[i]].append(
                hiredis.pack_command(cast(Any, ("EVALSHA", PUBLISH.sha, 3, *keys, *args)))
            )
            g.offset = off
            pending[node_of[i]] += 1
            sent += 1
        for node, cmds in bufs.items():
            if cmds:
                data = b"".join(cmds)
                if stamp_at_send:
                    data = data.replace(_HOLD_BYTES, b"%019d" % time.time_ns())
                conns[node][1].write(data)
        delay = t0 + (t + 1) * tick - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
    took = time.perf_counter() - t0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(10):
            while any(pending.values()):
                await asyncio.sleep(0.01)
    for task in readers:
        task.cancel()
    for _, w in conns.values():
        w.close()
    return {
        "sent": sent,
        "seconds": took,
        "cpu_s": self_cpu_s(),
        "publish_cpu_s": self_cpu_s() - cpu0,
        "replies": replies,
        "errors": len(errors),
        "first_errors": sorted(set(errors))[:5],
    }


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m bench.relay.publisher SPEC.json")
    spec = json.loads(Path(args[0]).read_text())
    if spec["mode"] == "flood":
        out = asyncio.run(publish_flood(spec["url"], spec["sids"], spec["frames"], spec["batch"]))
    else:
        out = asyncio.run(
            publish_paced(
                spec["url"],
                spec["sids"],
                spec["rate"],
                spec["seconds"],
                spec.get("tick_s", 0.01),
                stamp_at_send=spec.get("stamp", "send") == "send",
                opened=spec.get("opened"),
            )
        )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
