"""Slow catch-up readers of a Durable Stream from one address against one relay's memory.

What it answers: can sockets that ask for a large catch-up read and never read the answer
take a relay's memory, and does it come back when they are gone? The attack an attack
pass found: 100 sockets from one address, each ``GET /v1/stream/{path}?offset=-1`` of a
stream holding one 4 MiB message (the default ``--durable-max-body-bytes``), none reading
(a 4 KiB receive buffer), took a relay from 74 to 1,235 MiB, still held after they closed.

Participants: a local Redis Cluster (3 masters), one ``tokenrelay relay`` process with its
defaults but ``--durable-open-prefix /`` (no token: the per-token count does not apply, so
only the per-address count and the relay-wide budget stand in the way), and, in this
process, ``--readers`` raw sockets from 127.0.0.1 that send the request and never read,
held for ``--hold-s``; meanwhile a well-behaved reader from 127.0.0.2 reads the same stream
whole every second (how long each read took: it waits its turn behind the attackers'
bytes in memory, never for their sockets).

Measured: the relay's RSS (``/proc/<pid>/status``) before (after one whole read of the
stream, so the code paths are warm), its peak during the attack (sampled every 0.1 s), and
after the sockets closed (``--settle-s`` later); the relay's open descriptors at the end
of the hold (the sockets it cut); its ``replay_budget_peak`` (``/metrics``); the
well-behaved reader's reads and their longest time. Exit 1 when the RSS after is more than
10 % above the RSS before, or a well-behaved read failed.

Call order: ``python -m bench.hostile.slow_readers [--quick] [--readers N] [--json PATH]``
-> :func:`run`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from bench._util import raise_nofile, rss_kb
from bench.harness import Bench, Common, Outcome, bench_stack, flag

__all__ = ["Attack", "add_arguments", "main", "run", "run_from_args"]

MIB = 1 << 20


@dataclass(frozen=True)
class Attack:
    readers: int = 100
    message_bytes: int = 4 * MIB
    hold_s: float = 15.0  # past the relay's --write-timeout-s (10 s): it cuts them first
    settle_s: float = 3.0
    rounds: int = 2


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _open_reader(port: int, path: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    s.connect(("127.0.0.1", port))
    s.sendall(f"GET /v1/stream/{path}?offset=-1 HTTP/1.1\r\nHost: relay\r\n\r\n".encode())
    return s


async def _good_reads(
    http: aiohttp.ClientSession, url: str, size: int, stop: asyncio.Event
) -> dict[str, Any]:
    times: list[float] = []
    failed = 0
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            async with http.get(url, params={"offset": "-1"}) as r:
                body = await r.read()
                ok = r.status == 200 and len(body) == size
        except aiohttp.ClientError:
            ok = False
        times.append(time.monotonic() - t0)
        failed += not ok
        await asyncio.sleep(1.0)
    return {"reads": len(times), "failed": failed, "longest_s": round(max(times, default=0), 2)}


async def _metric(http: aiohttp.ClientSession, base: str, name: str) -> float | None:
    async with http.get(f"{base}/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return None


async def run(a: Attack) -> dict[str, Any]:
    raise_nofile(a.readers + 1024)
    async with bench_stack("slow-readers-") as st:
        url = await st.cluster(masters=3, replicas=0)
        relay = await st.serve("relay", lambda port: [
            sys.executable, "-m", "tokenrelay", "relay", "--port", str(port), "--redis", url,
            "--insecure-no-auth", "--relay-id", "slow-readers", "--log-level", "WARNING",
            "--durable-open-prefix", "/"], "/readyz")  # fmt: skip
        base, pid = relay.url, relay.pid
        path = f"slow/{uuid.uuid4().hex}"
        stream = f"{base}/v1/stream/{path}"
        good = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
        async with aiohttp.ClientSession(connector=good) as http:
            body = os.urandom(a.message_bytes)
            octets = {"Content-Type": "application/octet-stream"}
            async with http.put(stream, data=body, headers=octets) as r:
                if r.status != 201:
                    raise RuntimeError(f"PUT {r.status}: {await r.text()}")
            warm = await _good_reads(http, stream, a.message_bytes, _set_after(2.5))
            await asyncio.sleep(1.0)
            fresh = rss_kb(pid)
            # the same number of readers that do read, all at once: the relay's working set
            await asyncio.gather(*(_read_whole(base, stream) for _ in range(a.readers)))
            await asyncio.sleep(a.settle_s)
            before = rss_kb(pid)
            fds_before = _fds(pid)
            rounds = []
            for _ in range(a.rounds):
                rounds.append(await _attack(a, http, relay.port, pid, path, stream))
            budget_peak = await _metric(http, base, "tokenrelay_relay_hub_replay_budget_peak")
    last = rounds[-1]
    return {
        "attack": asdict(a),
        "rss_kb": {"fresh": fresh, "before": before, "peak": max(r["peak"] for r in rounds),
                   "after": last["after"], "after_each_round": [r["after"] for r in rounds]},
        "after_over_before": round(last["after"] / before, 3),
        "after_over_fresh": round(last["after"] / fresh, 3),
        "relay_fds": {"before": fds_before, "end_of_hold": last["fds_held"]},
        "replay_budget_peak_bytes": budget_peak,
        "good_reader": {"reads": sum(r["good"]["reads"] for r in rounds),
                        "failed": sum(r["good"]["failed"] for r in rounds),
                        "longest_s": max(r["good"]["longest_s"] for r in rounds)},
        "warm_reads": warm,
    }  # fmt: skip


async def _read_whole(base: str, stream: str) -> None:
    async with aiohttp.ClientSession() as http, http.get(stream, params={"offset": "-1"}) as r:
        await r.read()


async def _attack(
    a: Attack, http: aiohttp.ClientSession, port: int, pid: int, path: str, stream: str
) -> dict[str, Any]:
    """One round: the sockets, held ``hold_s`` while the well-behaved reader reads."""
    loop = asyncio.get_running_loop()
    socks = [await loop.run_in_executor(None, _open_reader, port, path) for _ in range(a.readers)]
    stop = asyncio.Event()
    good_task = asyncio.create_task(_good_reads(http, stream, a.message_bytes, stop))
    peak, t_end = rss_kb(pid), time.monotonic() + a.hold_s
    while time.monotonic() < t_end:
        peak = max(peak, rss_kb(pid))
        await asyncio.sleep(0.1)
    fds_held = _fds(pid)
    stop.set()
    good = await good_task
    for s in socks:
        s.close()
    await asyncio.sleep(a.settle_s)
    return {"peak": peak, "after": rss_kb(pid), "fds_held": fds_held, "good": good}


def _set_after(seconds: float) -> asyncio.Event:
    ev = asyncio.Event()
    asyncio.get_running_loop().call_later(seconds, ev.set)
    return ev


def _table(r: dict[str, Any]) -> str:
    rss, g = r["rss_kb"], r["good_reader"]
    peak = r["replay_budget_peak_bytes"]
    return "\n".join([
        f"{r['attack']['readers']} readers of a {r['attack']['message_bytes'] / MIB:g} MiB "
        f"message, never reading, for {r['attack']['hold_s']:g} s",
        f"relay RSS: {rss['fresh'] / 1024:.1f} MiB fresh, {rss['before'] / 1024:.1f} MiB "
        f"before (after {r['attack']['readers']} readers that read), "
        f"{rss['peak'] / 1024:.1f} MiB at peak, "
        f"{' / '.join(f'{x / 1024:.1f}' for x in rss['after_each_round'])} MiB after each "
        f"round ({r['after_over_before']:.3f} x before, {r['after_over_fresh']:.3f} x fresh)",
        f"relay descriptors: {r['relay_fds']['before']} before, "
        f"{r['relay_fds']['end_of_hold']} at the end of the hold",
        f"replay budget peak: {'-' if peak is None else f'{peak / MIB:.1f} MiB'}",
        f"well-behaved reader: {g['reads']} reads, {g['failed']} failed, "
        f"longest {g['longest_s']} s",
    ])  # fmt: skip


_D = Attack()


@dataclass
class Flags(Common):
    readers: int = flag(_D.readers, "sockets that never read", least=1)
    message_bytes: int = flag(_D.message_bytes, "bytes of the stream's one message", least=1)
    hold_s: float = flag(_D.hold_s, "how long the sockets are held", quick=12.0)
    settle_s: float = flag(_D.settle_s, "wait after they closed, before the last RSS")
    rounds: int = flag(_D.rounds, "attacks one after the other", least=1)


def _run(f: Flags) -> Outcome:
    res = asyncio.run(run(Attack(f.readers, f.message_bytes, f.hold_s, f.settle_s, f.rounds)))
    ok = res["after_over_before"] <= 1.10 and res["good_reader"]["failed"] == 0
    return Outcome(res, _table(res), 0 if ok else 1)


BENCH = Bench(Flags, _run, prog="python -m bench.hostile.slow_readers", description=__doc__,
              quick_help="the same attack held 12 s (~25 s in all)")  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
