"""The ceilings one relay process is measured against in :mod:`bench.relay.throughput`:
the same backlog drained by a Redis reader with no relay behind it.

- :func:`raw_phase`: one plain redis-py connection (``redis.asyncio.Redis(...).pubsub()``)
  SSUBSCRIBEd to K sessions of one master, idle while a publisher writes F frames per
  session, then drained: messages / seconds from its first read to its last
  (``raw_msgs_per_s``; ``ratio`` = relay / this).
- :func:`raw_hiredis_phase`: the project's own per-node hiredis reader
  (:class:`relay.broker.rediscluster.subscriber.ShardedSubscriber`, nothing behind it: no
  hub, no sockets) in a child process (``python -m bench.relay.ceilings --_hiredis SPEC``),
  SIGSTOPped while the publisher writes, then continued and drained the same way
  (``raw_hiredis_msgs_per_s``; ``ratio_hiredis`` = relay / this).

Both take the publisher runner of :mod:`bench.relay.harness`; the child is started and
stopped (by pid) with :mod:`devstack.procs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis.asyncio as aredis

from bench.relay.harness import run_publisher
from bench.relay.phases import Config
from devstack.procs import Proc, ProcError, log_line
from relay.broker.rediscluster.connect import connect
from relay.broker.rediscluster.subscriber import ShardedSubscriber
from relay.protocol.keys import live_channel
from relay.protocol.slotmap import Addr

__all__ = ["main", "raw_hiredis_phase", "raw_phase"]

Publish = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


# -- redis-py ------------------------------------------------------------------------------


async def raw_phase(url: str, master: Addr, sids: list[str], cfg: Config) -> dict[str, Any]:
    """redis-py drains ``cfg.frames`` frames per session, published while it waited."""
    r = aredis.Redis(host=master.host, port=master.port)
    ps = r.pubsub()
    try:
        for sid in sids:  # one call each: SSUBSCRIBE's channels must share a slot
            await ps.ssubscribe(live_channel(sid))
        confirmed = 0
        async with asyncio.timeout(30):
            while confirmed < len(sids):
                msg = await ps.get_message(timeout=1.0)
                if msg is not None and msg["type"] in ("ssubscribe", b"ssubscribe"):
                    confirmed += 1
        pub = await run_publisher(
            {"mode": "flood", "url": url, "sids": sids, "frames": cfg.frames, "batch": cfg.batch}
        )
        expected = pub["sent"]
        got = 0
        t0 = time.perf_counter()
        last = t0
        while got < expected:
            msg = await ps.get_message(ignore_subscribe_messages=True, timeout=5.0)
            if msg is None:
                break
            if msg["type"] in ("smessage", b"smessage"):
                got += 1
                last = time.perf_counter()
        took = last - t0
    finally:
        await ps.aclose()
        await r.aclose()
    return {
        "sessions": len(sids),
        "sent": expected,
        "received": got,
        "seconds": round(took, 3),
        "msgs_per_s": round(got / took) if took > 0 else 0,
        "publisher_frames_per_s": round(pub["sent"] / pub["seconds"]),
    }


# -- the relay's own hiredis reader, alone -------------------------------------------------


async def _hiredis_reader(url: str, sids: list[str], expected: int) -> None:
    """Child process: subscribe, say ``ready``, count messages until ``expected``."""
    redis = connect(url)
    await redis.initialize()
    got = 0
    first = last = 0.0
    done = asyncio.Event()

    def on_message(msgs: list[list[bytes]]) -> None:
        nonlocal got, first, last
        now = time.perf_counter()
        if got == 0:
            first = now
        got += len(msgs)
        last = now
        if got >= expected:
            done.set()

    sub = ShardedSubscriber(
        redis, on_message=on_message, on_resubscribed=lambda _: None, relay_id="bench-hiredis"
    )
    await sub.start()
    try:
        await sub.subscribe([live_channel(s) for s in sids])
        print("ready", flush=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(120):
                await done.wait()
        print(json.dumps({"received": got, "seconds": last - first}), flush=True)
    finally:
        await sub.close()
        await redis.aclose()


async def raw_hiredis_phase(
    url: str, sids: list[str], frames: int, publish: Publish
) -> dict[str, Any]:
    """The hiredis reader (a child) drains ``frames`` frames per session, published while
    it was stopped."""
    expected = len(sids) * frames
    with tempfile.TemporaryDirectory(prefix="relay-bench-hiredis-") as tmp:
        spec, log = Path(tmp) / "spec.json", Path(tmp) / "reader.log"
        spec.write_text(json.dumps({"url": url, "sids": sids, "expected": expected}))
        argv = [sys.executable, "-m", "bench.relay.ceilings", "--_hiredis", str(spec)]
        proc = Proc.start(argv, log=log, name="hiredis reader")
        try:
            await proc.ready(log_line("ready"), timeout_s=60)
            proc.send(signal.SIGSTOP)
            try:
                pub = await publish(
                    {"mode": "flood", "url": url, "sids": sids, "frames": frames, "batch": 50}
                )
            finally:
                proc.send(signal.SIGCONT)
            if await proc.wait(150) != 0:
                raise ProcError(proc.why())
            out = json.loads(log.read_text().strip().splitlines()[-1])
        finally:
            await proc.stop()
    took = float(out["seconds"])
    return {
        "sessions": len(sids),
        "sent": pub["sent"],
        "received": out["received"],
        "lost": pub["sent"] - out["received"],
        "seconds": round(took, 3),
        "msgs_per_s": round(out["received"] / took) if took > 0 else 0,
    }


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--_hiredis":
        spec = json.loads(Path(sys.argv[2]).read_text())
        asyncio.run(_hiredis_reader(spec["url"], spec["sids"], spec["expected"]))
        return
    raise SystemExit("usage: this module is run by bench.relay.throughput")


if __name__ == "__main__":
    main()
