"""The relay's anatomy, measured: a live frame's walk through the code, and the objects an
idle connection holds.

- **The walk.** A relay (this process, the plain asyncio loop so that the transport's
  write is Python code the profiler sees) streams one session to one SSE client (and
  then one WebSocket client); one more token frame is published, and ``sys.setprofile``
  records every call of the project's own code from the moment the shard connection's
  ``data_received`` starts until the relay's socket ``write``: the modules and
  functions the frame passes, in call order. Printed: the calls, the visits (a visit
  is a run of consecutive calls in one module: entering a module again after another
  is a new visit), the distinct modules, and the modules entered more than once.
- **Idle objects.** ``--idle`` SSE streams (then as many WebSockets) are opened on a
  fresh session each and left idle, then as many SSE streams of one session; the
  objects the garbage collector tracks are counted by type before and after, and
  divided by the number of connections: the project's own types, and every type
  (aiohttp's request objects, futures, lists...). With a session each, the session's
  channel (its state in the hub, its resume) counts per connection; on one session it
  does not.

``python -m bench.relay.anatomy [--redis URL] [--idle N] [--json PATH]``
(a local Redis Cluster is started unless ``--redis``). ``--seed`` is accepted for the
benchmarks' common command line; nothing here is random.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
from aiohttp import web

from bench.harness import Bench, OnCluster, Outcome, bench_stack, flag
from devstack.procs import free_port
from relay.broker.rediscluster.connect import connect
from relay.broker.rediscluster.publisher import Generation, Publisher
from relay.edge.config import RelayConfig
from relay.edge.http.app import make_app, make_runner
from relay.protocol.keys import new_session_id

__all__ = ["add_arguments", "count_idle", "main", "run_from_args", "trace_walk"]

ROOT = Path(__file__).resolve().parents[2]
_PROJECT = tuple(str(ROOT / p) for p in ("relay", "worker", "devstack"))


@contextlib.asynccontextmanager
async def _relay(url: str) -> AsyncIterator[int]:
    port = free_port()
    cfg = RelayConfig(
        port=port,
        redis_url=url,
        insecure_no_auth=True,
        relay_id="anatomy",
        reap_after_s=0,
        unsubscribe_delay_s=0,
    )
    runner = make_runner(make_app(cfg))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield port
    finally:
        await runner.cleanup()


def _walk_of(events: list[tuple[str, str, int]]) -> dict[str, Any]:
    visits: list[str] = []
    for module, _, _ in events:
        if not visits or visits[-1] != module:
            visits.append(module)
    counts = Counter(visits)
    return {
        "calls": len(events),
        "visits": len(visits),
        "modules": len(counts),
        "revisited": sorted(m for m, n in counts.items() if n > 1),
        "path": visits,
        "trace": [f"{'  ' * (depth - events[0][2])}{m}:{q}" for m, q, depth in events],
    }


async def _one_frame_traced(gen: Generation, until: Any) -> list[tuple[str, str, int]]:
    """Publish one token and record the project's calls from the shard connection's
    data_received to the first socket write (asyncio's selector transport)."""
    events: list[tuple[str, str, int]] = []
    state = {"depth": 0, "started": False, "done": False}

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if state["done"]:
            return
        code = frame.f_code
        if event == "call":
            name = code.co_filename
            if not state["started"]:
                if code.co_name != "data_received" or not name.endswith("nodeconn.py"):
                    return
                state["started"] = True
            state["depth"] += 1
            if code.co_name == "write" and name.endswith("selector_events.py"):
                state["done"] = True  # the socket write: the walk ends here
                return
            if name.startswith(_PROJECT):
                module = str(Path(name).relative_to(ROOT))
                events.append((module, code.co_qualname, state["depth"]))
        elif event == "return" and state["started"]:
            state["depth"] -= 1
            if state["depth"] == 0:  # the read ended without a write to the socket
                state["done"] = True

    sys.setprofile(profile)
    try:
        await gen.token("traced")
        await until()
    finally:
        sys.setprofile(None)
    return events


async def trace_walk(url: str) -> dict[str, Any]:
    """The walk of one live frame to an SSE socket and to a WebSocket."""
    redis = connect(url)
    await redis.initialize()
    out: dict[str, Any] = {}
    try:
        async with _relay(url) as port, aiohttp.ClientSession() as http:
            pub = Publisher(redis)
            for transport in ("sse", "ws"):
                sid = new_session_id()
                gen = await pub.open_generation(sid)
                await gen.token("warm")
                base = f"http://127.0.0.1:{port}/v1/sessions/{sid}"
                if transport == "sse":
                    resp = await http.get(f"{base}/events?last_event_id=0")
                    await resp.content.readuntil(b'"warm"')

                    async def sse_until(r: aiohttp.ClientResponse = resp) -> None:
                        await r.content.readuntil(b'"traced"')

                    await gen.token("x")  # the path once, untraced (caches, first calls)
                    await resp.content.readuntil(b'"x"')
                    await asyncio.sleep(0.2)
                    events = await _one_frame_traced(gen, sse_until)
                    resp.close()
                else:
                    ws = await http.ws_connect(f"{base}/ws?from=0")

                    async def ws_until(w: aiohttp.ClientWebSocketResponse = ws) -> None:
                        while '"traced"' not in (await w.receive_str()):
                            pass

                    while '"warm"' not in (await ws.receive_str()):
                        pass
                    await gen.token("x")
                    while '"x"' not in (await ws.receive_str()):
                        pass
                    await asyncio.sleep(0.2)
                    events = await _one_frame_traced(gen, ws_until)
                    await ws.close()
                out[transport] = _walk_of(events)
    finally:
        await redis.aclose()
    return out


def _census() -> Counter[str]:
    gc.collect()
    out: Counter[str] = Counter()
    for obj in gc.get_objects():
        t = type(obj)
        out[f"{t.__module__}.{t.__qualname__}"] += 1
    return out


# The idle clients, in a child process of their own (so that the census counts only the
# relay's objects): raw sockets, each a GET of one session's stream (an SSE request or a
# WebSocket upgrade), the reply's head read, then nothing until stdin closes.
_CLIENTS = r"""
import base64, os, socket, sys
port, n, kind, shared = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
socks = []
for i in range(n):
    s = socket.create_connection(("127.0.0.1", port))
    sid = f"anatomy{os.getpid()}" + ("" if shared else f"x{i}")
    path = f"/v1/sessions/{sid}/" + ("events" if kind == "sse" else "ws")
    head = f"GET {path} HTTP/1.1\r\nHost: x\r\n"
    if kind == "ws":
        key = base64.b64encode(os.urandom(16)).decode()
        head += f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
        head += "Sec-WebSocket-Version: 13\r\n"
    s.sendall((head + "\r\n").encode())
    got = b""
    while b"hello" not in got:
        got += s.recv(65536)
    socks.append(s)
print("ready", flush=True)
sys.stdin.read()
"""


async def count_idle(url: str, n: int) -> dict[str, Any]:
    """Objects per idle connection, by type: ``n`` SSE streams and ``n`` WebSockets, each
    on a session of its own (so the session's channel counts per connection), then ``n``
    SSE streams of one session (``sse_one_session``: the connection's own objects only).
    The clients run in a child process, stopped by its pid."""
    out: dict[str, Any] = {}
    async with _relay(url) as port:
        for name in ("sse", "ws", "sse_one_session"):
            transport, shared = name.split("_")[0], name.endswith("one_session")
            await asyncio.sleep(1.0)  # the last phase's connections and channels are gone
            before = _census()
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _CLIENTS, str(port), str(n), transport, str(int(shared)),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            try:
                assert proc.stdout is not None
                assert proc.stdin is not None
                line = await asyncio.wait_for(proc.stdout.readline(), 60)
                if line.strip() != b"ready":
                    raise RuntimeError(f"the idle clients did not start: {line!r}")
                await asyncio.sleep(1.0)
                after = _census()
                proc.stdin.close()
                await asyncio.wait_for(proc.wait(), 10)
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            # types with at least one more object per connection (a shared session's
            # channel, one in all, is below that bar: it is not the connection's)
            diff = {k: (after[k] - before[k]) / n for k in after if after[k] - before[k] >= n}
            own = {k: v for k, v in diff.items() if k.startswith(("relay.", "worker."))}
            out[name] = {"project": own, "all": dict(sorted(diff.items()))}
            await asyncio.sleep(0.5)
    return out


@dataclass
class Flags(OnCluster):
    idle: int = flag(200, "idle connections per transport", quick=50, least=1)
    seed: int = flag(0, "(nothing here is random)")


def _run(f: Flags) -> Outcome:
    async def run() -> dict[str, Any]:
        async with bench_stack("anatomy-") as st:
            url = await st.cluster(masters=3, replicas=0, url=f.redis)
            return {"walk": await trace_walk(url), "idle": await count_idle(url, f.idle)}

    res = asyncio.run(run())  # the plain asyncio loop: its transport's write is Python
    lines: list[str] = []
    for transport, w in res["walk"].items():
        again = w["revisited"] or "none"
        lines.append(f"walk ({transport}): {w['calls']} calls, {w['visits']} visits of "
                     f"{w['modules']} modules, entered again: {again}")  # fmt: skip
        lines.append("  " + " -> ".join(w["path"]))
        lines += ["    " + line for line in w["trace"]]
    for transport, c in res["idle"].items():
        own = ", ".join(f"{k} {v:g}" for k, v in sorted(c["project"].items()))
        lines.append(f"idle {transport}: project objects per connection: {own or 'none'}")
        every = ", ".join(f"{k} {v:g}" for k, v in c["all"].items())
        lines.append(f"  every tracked object per connection: {every}")
    return Outcome(res, "\n".join(lines))


BENCH = Bench(Flags, _run, prog="python -m bench.relay.anatomy", description=__doc__,
              quick_help="50 idle connections per transport")  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
