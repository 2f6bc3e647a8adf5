"""tokenrelay's producer in the LLM-rate phases of :mod:`bench.peers.pathcost`, as a child
process (its CPU is its own): the tokens of a drawn schedule (:func:`bench.peers.llmshape.ticks`)
through the worker's coalescing (:class:`relay.producer.coalesce.Coalescer`, flush window
and size from the spec, the first token of each reply at once), each flush one call of the
real publish script (fence, XADD to the backlog, SPUBLISH), pipelined per master on raw
connections, one write per master per 10 ms tick.

Each token's text is its own stamp (``<19-digit ns>;``, taken at the tick it was due), so a
frame that coalesced several tokens carries several stamps and every token's latency
includes the time it waited in the coalescer.

``python -m bench.peers.llmpub SPEC.json``; spec: ``url``, ``opened`` (the sessions'
generations, :func:`bench.relay.publisher.open_generations`), ``ticks``, ``tick_s``,
``max_tokens``, ``max_delay_s``. Prints one JSON line: ``sent`` (tokens), ``frames``,
``seconds``, ``cpu_s``, ``publish_cpu_s``, ``errors``, ``wait_ms_mean``/``wait_ms_max``
(the coalescer's added delay per token).
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
from bench.peers.llmshape import session_of
from bench.relay.harness import slotmap
from relay.broker.rediscluster.connect import connect
from relay.broker.rediscluster.nodeconn import raw_command
from relay.broker.rediscluster.publisher import Generation, Publisher
from relay.broker.rediscluster.scripts import PUBLISH
from relay.producer.coalesce import Batch, CoalescePolicy, Coalescer
from relay.protocol.frame import Frame, encode
from relay.protocol.keys import live_channel
from relay.protocol.slotmap import Addr, slot_of

__all__ = ["main", "publish_llm"]


async def publish_llm(
    url: str, opened: list[list[Any]], plan: list[list[int]], tick: float, policy: CoalescePolicy
) -> dict[str, Any]:
    pub = Publisher(connect(url))  # its settings (maxlen, TTL) for the script's arguments
    gens = [Generation(pub, s, int(e), int(t), int(o), str(g)) for s, e, t, o, g in opened]
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

    async def read_replies(node: Addr) -> None:
        parser = hiredis.Reader()
        while chunk := await conns[node][0].read(1 << 16):
            parser.feed(chunk)
            while (r := parser.gets()) is not False:
                pending[node] -= 1
                if isinstance(r, hiredis.ReplyError):
                    errors.append(str(r)[:80])

    readers = [asyncio.create_task(read_replies(n)) for n in conns]
    coal = [Coalescer(policy) for _ in gens]
    waiting: set[int] = set()  # sessions with tokens in their coalescer
    sent = frames = 0
    waits: list[float] = []
    bufs: dict[Addr, list[bytes]] = {n: [] for n in conns}

    def out(i: int, batch: Batch) -> None:
        nonlocal frames
        g = gens[i]
        frame = encode(Frame(session=g.session, turn=g.turn, offset=g.offset + 1, kind="token",
                             text=batch.text, epoch=g.epoch, ts=time.time_ns() // 1_000_000,
                             meta={"gen": g.gen}))  # fmt: skip
        keys, args = g.script_call(g.offset, [frame])
        bufs[node_of[i]].append(
            hiredis.pack_command(cast(Any, ("EVALSHA", PUBLISH.sha, 3, *keys, *args)))
        )
        g.offset += 1
        pending[node_of[i]] += 1
        frames += 1
        waits.extend(batch.waits)

    cpu0 = self_cpu_s()
    t0 = time.perf_counter()
    for t, due in enumerate(plan):
        now = time.perf_counter()
        for entry in due:
            i = session_of(entry)
            if entry < 0:  # a new reply: its turn's coalescing starts again
                rest = coal[i].flush(now)
                if rest is not None:
                    out(i, rest)
                coal[i] = Coalescer(policy)
            batch = coal[i].push(f"{time.time_ns():019d};", now)
            sent += 1
            if batch is not None:
                out(i, batch)
            if coal[i].pending:
                waiting.add(i)
        for i in list(waiting):
            batch = coal[i].poll(now)
            if batch is not None:
                out(i, batch)
            if not coal[i].pending:
                waiting.discard(i)
        for node, cmds in bufs.items():
            if cmds:
                conns[node][1].write(b"".join(cmds))
                cmds.clear()
        delay = t0 + (t + 1) * tick - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
    now = time.perf_counter()
    for i in waiting:  # the end of the schedule: what is pending goes out
        batch = coal[i].flush(now)
        if batch is not None:
            out(i, batch)
    for node, cmds in bufs.items():
        if cmds:
            conns[node][1].write(b"".join(cmds))
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
        "sent": sent, "frames": frames, "seconds": took, "cpu_s": self_cpu_s(),
        "publish_cpu_s": self_cpu_s() - cpu0, "errors": len(errors),
        "first_errors": sorted(set(errors))[:5],
        "wait_ms_mean": round(1e3 * sum(waits) / max(len(waits), 1), 2),
        "wait_ms_max": round(1e3 * max(waits, default=0.0), 2),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m bench.peers.llmpub SPEC.json")
    spec = json.loads(Path(args[0]).read_text())
    policy = CoalescePolicy(max_tokens=int(spec["max_tokens"]), max_delay_s=spec["max_delay_s"])
    got = asyncio.run(
        publish_llm(spec["url"], spec["opened"], spec["ticks"], spec.get("tick_s", 0.01), policy)
    )
    print(json.dumps(got), flush=True)


if __name__ == "__main__":
    main()
