"""The systems of the whole-path benchmark that have a server (each a
:class:`bench.peers.pathsystem.System`): tokenrelay's relay (WebSocket or SSE readers), the
bare relay (SSE, the floor of a relay's CPU per frame) and Socket.IO 4.8 with its sharded
Redis adapter.

Each is started once per run on the cluster of :class:`Bench` and stopped by pid; a round
is :func:`bench.peers.pathround.measure` on fresh sessions. Producers:

- tokenrelay and the bare relay: the project's paced publisher (``bench.relay.publisher``,
  a child process): one call of the real publish script per token (fence, XADD to the
  backlog, SPUBLISH), stamped as each frame is made, as the Socket.IO emitter stamps;
- Socket.IO: ``bench/peers/js/socketio_emit.cjs`` (``io.to(room).emit``, one SPUBLISH per
  message through the sharded adapter, one XADD through the streams adapter), on the same
  10 ms tick;
- Centrifugo: :mod:`bench.peers.centrifugo_pub` (its server API, one ``batch`` of
  ``publish`` commands per tick).

In the LLM-rate phases every producer sends the round's drawn schedule
(:mod:`bench.peers.llmshape`); tokenrelay's through the worker's coalescing
(:mod:`bench.peers.llmpub`, flush size and window from :class:`Bench`), the peers' one
message per token as their docs' examples publish.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._util import run_json
from bench.peers import centrifugo as cf
from bench.peers.llmshape import even_ticks
from bench.peers.node import emit, socketio_server
from bench.peers.pathround import Backlog, MakeReader, Transport, measure
from bench.peers.pathsystem import Phase, RoundFigures
from bench.peers.ws_clients import Kind
from bench.relay.harness import RelayProc, bare_process, relay_process, run_publisher, sessions
from bench.relay.publisher import open_generations
from relay.protocol.keys import live_channel
from relay.protocol.slotmap import Addr, SlotMap

__all__ = ["GUARANTEES", "Bench", "CentrifugoSystem", "RelaySystem", "SocketIOSystem"]

GUARANTEES: dict[str, str] = {
    "tokenrelay": (
        "every token in a replicated Redis backlog before it is published: a reader resumes "
        "from its offset with no gap or duplicate, through any relay, after the end of the "
        "turn and after its producer died"
    ),
    "tokenrelay-sse": "as tokenrelay (its readers over SSE, for the relay-vs-bare ratio)",
    "bare": (
        "a measuring stick, not a server: live only (no backlog read, resume, order check, "
        "token check, heartbeat or flow control); the same producer and backlog as tokenrelay"
    ),
    "socketio": (
        "at most once: a live broadcast through Redis sharded Pub/Sub; a reader that "
        "reconnects gets only what is sent after it is back (this bench's client asks no "
        "state recovery; the sharded adapter keeps nothing to recover from), nothing after "
        "the end, and nothing once its producer died"
    ),
    "socketio-streams": (
        "recovery within a window: every broadcast XADDed to one Redis stream (MAXLEN ~10,000 "
        "entries over all rooms, on one master), and a client back within 2 minutes with its "
        "session id and last offset gets what it missed from that stream (connection state "
        "recovery); nothing once the stream trimmed past its offset, no replay of a finished "
        "reply to a new screen"
    ),
    "centrifugo": (
        "recovery from a bounded history: every publication in its channel's Redis stream "
        "(2,000 publications, 300 s) with offset and epoch before it is published; a client "
        "that resubscribes with its position gets what it missed (force_recovery), or is "
        "told it cannot (epoch changed, history trimmed); a new screen can read the history "
        "of a finished reply while it lasts; no fence against a second producer"
    ),
}


@dataclass
class Bench:
    """What every system of one run shares: the cluster, its slot map, a log directory,
    Socket.IO's ``node_modules``, the largest number of readers a phase opens."""

    url: str
    seed: Addr
    smap: SlotMap
    log_dir: Path
    modules: Path | None
    max_conn: int
    warm_s: float
    centrifugo: Path | None = None  # the built binary, when there is one
    coalesce: tuple[int, float] = (8, 0.05)  # tokenrelay's flush size and window (LLM phases)


class _ServerSystem:
    """A server process started once; each round on fresh sessions."""

    name: str
    guarantee: str
    kind: Kind
    transport: Transport
    resumes: bool
    held: bool

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.stack = contextlib.AsyncExitStack()
        self.server: RelayProc | None = None

    def supports(self, phase: Phase) -> bool:
        return phase.kind == "steady" or self.transport == "ws"  # SSE: the bare-ratio phases

    async def stop(self) -> None:
        await self.stack.aclose()
        self.server = None

    async def publish(
        self, sids: list[str], rate: float, seconds: float, plan: list[list[int]] | None
    ) -> dict[str, Any]:
        raise NotImplementedError

    def channel(self, sid: str) -> str | None:
        """The shard channel a round waits to have a subscriber on (None: no such wait)."""
        return live_channel(sid)

    prepare: Callable[[list[str]], Coroutine[Any, Any, None]] | None = None
    make_reader: MakeReader | None = None
    backlog: Backlog | None = None

    def clock(self) -> int:
        return time.time_ns()

    async def round(self, phase: Phase, seed: int) -> RoundFigures:
        if self.server is None:
            raise RuntimeError(f"{self.name}: round before start")
        b = self.bench
        sids = sessions(phase.sessions, b.smap, None)
        return await measure(
            self.name, self.kind, self.transport, phase, port=self.server.port,
            pid=self.server.pid, smap=b.smap, sids=sids,
            channels=[c for c in map(self.channel, sids) if c is not None],
            publish=self.publish, clock=self.clock, resumes=self.resumes, held=self.held,
            warm_s=b.warm_s, prepare=self.prepare, seed=seed, make=self.make_reader,
            backlog=self.backlog,
        )  # fmt: skip


class RelaySystem(_ServerSystem):
    """``tokenrelay relay`` (:func:`bench.relay.harness.relay_process`), or with ``bare``
    the bare relay (:mod:`bench.relay.bare`); the paced publisher as producer."""

    kind: Kind = "tokenrelay"
    held = True

    def __init__(self, bench: Bench, transport: Transport = "ws", *, bare: bool = False) -> None:
        super().__init__(bench)
        self.bare = bare
        self.transport = "sse" if bare else transport
        self.name = "bare" if bare else ("tokenrelay" if transport == "ws" else "tokenrelay-sse")
        self.guarantee = GUARANTEES[self.name]
        self.resumes = not bare
        self._opened: list[list[Any]] | None = None

    async def start(self) -> None:
        b = self.bench
        if self.bare:
            cm = bare_process(b.url, b.log_dir)
        else:
            cm = relay_process(b.url, b.log_dir, f"pathcost-{self.name}", b.max_conn)
        self.server = await self.stack.enter_async_context(cm)

    async def prepare(self, sids: list[str]) -> None:
        """Open every session's turn (one generation each) before the round's window: a
        turn's opening is counted per turn (the round's ``open_redis_us_per_turn``), not
        as per-token work of a round whose turns are a few seconds long."""
        self._opened = await open_generations(self.bench.url, sids)

    async def publish(
        self, sids: list[str], rate: float, seconds: float, plan: list[list[int]] | None
    ) -> dict[str, Any]:
        if plan is not None:  # an LLM-rate phase: the worker's coalescing
            n, window = self.bench.coalesce
            llm = {"url": self.bench.url, "opened": self._opened, "ticks": plan,
                   "max_tokens": n, "max_delay_s": window}  # fmt: skip
            argv = [sys.executable, "-m", "bench.peers.llmpub"]
            return await run_json(argv, llm, name="LLM-rate publisher", timeout_s=seconds + 120)
        spec = {"mode": "paced", "url": self.bench.url, "sids": sids, "rate": rate,
                "seconds": seconds, "stamp": "build", "opened": self._opened}  # fmt: skip
        return await run_publisher(spec)


class SocketIOSystem(_ServerSystem):
    """``bench/peers/js/socketio_server.cjs`` and its emitter (:mod:`bench.peers.node`):
    the sharded adapter (``socketio``, at most once) or, with ``streams``, the streams
    adapter with connection state recovery (``socketio-streams``: its readers resume with
    their session id and last offset in the storm)."""

    transport: Transport = "ws"
    held = False

    def __init__(self, bench: Bench, *, streams: bool = False) -> None:
        super().__init__(bench)
        self.adapter = "streams" if streams else "sharded"
        self.name = "socketio-streams" if streams else "socketio"
        self.guarantee = GUARANTEES[self.name]
        self.kind = "socketio-csr" if streams else "socketio"
        self.resumes = streams

    async def start(self) -> None:
        b = self.bench
        if b.modules is None:
            raise RuntimeError("Socket.IO's node_modules are not installed")
        self.server = await self.stack.enter_async_context(
            socketio_server(b.modules, b.seed, b.log_dir, self.adapter)
        )

    def channel(self, sid: str) -> str | None:
        return None if self.adapter == "streams" else f"socket.io#/#{sid}#"

    def clock(self) -> int:
        return time.monotonic_ns()

    async def publish(
        self, sids: list[str], rate: float, seconds: float, plan: list[list[int]] | None
    ) -> dict[str, Any]:
        assert self.bench.modules is not None
        return await emit(self.bench.modules, self.bench.seed, sids, rate, seconds, plan,
                          self.adapter)  # fmt: skip


class CentrifugoSystem(_ServerSystem):
    """Centrifugo v6 (:mod:`bench.peers.centrifugo`): its Redis engine on the run's
    cluster, screens through its Python SDK, losses counted against its history."""

    name = "centrifugo"
    guarantee = GUARANTEES["centrifugo"]
    kind: Kind = "socketio"  # unused: its screens are its SDK's (make_reader)
    transport: Transport = "ws"
    resumes = True
    held = True

    async def start(self) -> None:
        b = self.bench
        if b.centrifugo is None:
            raise RuntimeError("Centrifugo is not built")
        self.server = await self.stack.enter_async_context(
            cf.centrifugo_server(b.centrifugo, b.seed, b.log_dir)
        )
        self.make_reader = cf.CentrifugoReader
        port = self.server.port

        async def history(sids: list[str]) -> dict[str, set[int]]:
            return await cf.history_stamps(port, sids)

        self.backlog = history

    def channel(self, sid: str) -> str | None:
        return None  # classic Pub/Sub: a subscribed SDK client is subscribed in Redis

    async def publish(
        self, sids: list[str], rate: float, seconds: float, plan: list[list[int]] | None
    ) -> dict[str, Any]:
        assert self.server is not None
        ticks = plan if plan is not None else even_ticks(len(sids), rate, seconds)
        spec = {"port": self.server.port, "key": cf.API_KEY,
                "channels": [cf.channel(s) for s in sids], "ticks": ticks}  # fmt: skip
        argv = [sys.executable, "-m", "bench.peers.centrifugo_pub"]
        return await run_json(argv, spec, name="Centrifugo publisher", timeout_s=seconds + 120)
