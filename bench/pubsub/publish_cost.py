"""Redis CPU per published frame: the producer's publish script against the floor a
backlogged publish cannot go under, on a local 3 + 3 Redis Cluster, in one run.

Variants, each on the same sessions' shape and the same paced load (``rate`` frames/s
over ``sessions`` sessions, ``batch`` frames per call, a 10 ms tick, one pipelined write
per master per tick, raw RESP connections):

- ``floor``: per frame, ``XADD log MAXLEN ~ <maxlen> <offset>-1 f <frame> b <start>`` and
  ``SPUBLISH live <frame>``, pipelined, no script: what any producer that keeps a backlog
  in Redis and publishes live pays (no fencing, no offset check, no TTL);
- ``before``: the publish script as it was before its per-frame writes were cut
  (``bench/pubsub/lua/publish_before.lua``: HMGET, HGET, XADD, SPUBLISH, HSET, HSET,
  HSETNX, EXPIRE, EXPIRE per call);
- ``script``: the product's ``relay/broker/rediscluster/lua/publish.lua`` by EVALSHA (the
  call :class:`relay.broker.rediscluster.publisher.Generation` makes);
- ``script_pttl``: the product's script as it was before its per-call PTTL went
  (``bench/pubsub/lua/publish_pttl.lua``: HMGET, XADD, SPUBLISH, HSET, PTTL per call),
  given today's ARGV without the producer's clock (as ``before`` is);
- ``function``: the same script body as a Redis 7 function (``FUNCTION LOAD``, ``FCALL``).

Every variant's sessions are opened by the product's ``OPEN`` script first (outside the
measured window). With ``subscribed`` (the default), one raw connection per master
``SSUBSCRIBE``s every session's channel, as a relay does, and counts what it gets.

Measured per variant (medians of ``rounds``, variants in an order shuffled by ``--seed``
per round): Redis CPU (``INFO cpu`` ``used_cpu_sys`` + ``used_cpu_user`` of each node)
over the window, minus the same nodes' CPU over an idle window of the same length
measured in the same round (cluster-bus pings, cron), per frame published, for masters,
replicas and both; the commands the masters ran per frame (``INFO commandstats``: calls,
commands run inside scripts included); each as a ratio to ``floor`` of the same round.
The run checks that every frame landed (each session's ``offset`` and stream length) and
was delivered once to the subscriber; a difference is an error (exit 1).

``--report PATH`` prints a run's JSON as the Markdown table of bench/README.md.

Call order: ``python -m bench.pubsub.publish_cost [--quick] [--json PATH] [--seed N]`` ->
:func:`run_from_args` -> :func:`run` -> per round and batch :func:`_measure` per
variant.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import hiredis

from bench.harness import Bench, Common, Outcome, flag
from bench.harness.report import progress as _progress
from bench.relay.harness import sessions, slotmap
from devstack.cluster.launcher import local_cluster
from relay.broker.rediscluster.connect import connect
from relay.broker.rediscluster.nodeconn import raw_command
from relay.broker.rediscluster.publisher import Generation, Publisher
from relay.broker.rediscluster.scripts import PUBLISH, lua
from relay.protocol.frame import Frame, encode
from relay.protocol.keys import live_channel, log_key, meta_key
from relay.protocol.slotmap import Addr, SlotMap, slot_of

__all__ = ["VARIANTS", "Config", "add_arguments", "main", "run", "run_from_args"]

VARIANTS = ("floor", "lua_floor", "before", "script", "script_pttl", "function")
# variants whose script takes the frames from ARGV[9] (before the producer's clock was added)
_NO_CLOCK = ("before", "script_pttl")
BEFORE_SOURCE = (
    lua("backlog") + "\n" + (Path(__file__).parent / "lua" / "publish_before.lua").read_text()
)
PTTL_SOURCE = (
    lua("backlog") + "\n" + (Path(__file__).parent / "lua" / "publish_pttl.lua").read_text()
)
# The least any script can do: the floor's XADD and SPUBLISH, inside EVALSHA, same ARGV.
LUA_FLOOR_SOURCE = """local off, total = tonumber(ARGV[2]), 0
for i = 10, #ARGV do
  off = off + 1
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], off .. '-1', 'f', ARGV[i], 'b', total)
  redis.call('SPUBLISH', KEYS[3], ARGV[i])
  total = total + #ARGV[i]
end
return off
"""
FUNCTION_NAME = "tr_publish_bench"


def function_library(source: str) -> str:
    """``source`` (a script of KEYS and ARGV) as a Redis 7 function library."""
    return (
        "#!lua name=tr_publish_bench\n"
        f"local function body(KEYS, ARGV)\n{source}\nend\n"
        f"redis.register_function('{FUNCTION_NAME}', body)\n"
    )


@dataclass
class Config:
    sessions: int = 300
    rate: int = 5_000  # frames/s over all sessions
    seconds: float = 5.0  # publishing time per variant
    batches: tuple[int, ...] = (1, 4)  # frames per call (per coalesced flush)
    rounds: int = 3
    subscribed: bool = True  # a relay-like SSUBSCRIBE of every session's channel
    seed: int = 0
    tick_s: float = 0.01

    @classmethod
    def quick(cls) -> Config:
        return cls(sessions=200, rate=4_000, seconds=2.0, rounds=2)


# -- Redis counters ----------------------------------------------------------------------


async def _cpu(nodes: Sequence[Addr]) -> dict[Addr, float]:
    out = {}
    for node in nodes:
        text = (await raw_command(node, "INFO", "cpu")).decode()
        out[node] = sum(
            float(line.split(":", 1)[1])
            for line in text.splitlines()
            if line.startswith(("used_cpu_sys:", "used_cpu_user:"))
        )
    return out


async def _calls(nodes: Sequence[Addr]) -> dict[str, int]:
    """Calls per command, summed over ``nodes`` (``INFO commandstats``)."""
    out: dict[str, int] = {}
    for node in nodes:
        text = (await raw_command(node, "INFO", "commandstats")).decode()
        for line in text.splitlines():
            if line.startswith("cmdstat_"):
                name, rest = line[len("cmdstat_") :].split(":", 1)
                calls = int(rest.split(",", 1)[0].split("=", 1)[1])
                out[name] = out.get(name, 0) + calls
    return out


# -- the subscriber ----------------------------------------------------------------------


class Subscriber:
    """One connection per master, SSUBSCRIBEd to the channels of its slots; counts."""

    def __init__(self) -> None:
        self.conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.got: dict[bytes, int] = {}
        self.confirmed = 0

    async def open(self, smap: SlotMap, channels: Sequence[str]) -> None:
        by_node: dict[Addr, list[str]] = {}
        for ch in channels:
            node = smap.node_for(slot_of(ch))
            assert node is not None
            by_node.setdefault(node, []).append(ch)
        for node, chans in by_node.items():
            reader, writer = await asyncio.open_connection(node.host, node.port)
            writer.write(b"".join(_pack("SSUBSCRIBE", ch) for ch in chans))
            self.conns.append((reader, writer))
            self.tasks.append(asyncio.create_task(self._read(reader)))
        async with asyncio.timeout(30):
            while self.confirmed < len(channels):
                await asyncio.sleep(0.02)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        parser = hiredis.Reader()
        while chunk := await reader.read(1 << 16):
            parser.feed(chunk)
            while (msg := parser.gets()) is not False:
                if msg[0] == b"smessage":
                    self.got[msg[1]] = self.got.get(msg[1], 0) + 1
                elif msg[0] == b"ssubscribe":
                    self.confirmed += 1

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for _, w in self.conns:
            w.close()


# -- one variant -------------------------------------------------------------------------


@dataclass
class Load:
    """The sessions of one variant, their generations and where each lives."""

    gens: list[Generation]
    node_of: list[Addr]
    totals: list[int] = field(default_factory=list)  # the floor's byte count per session


def _frame(g: Generation, off: int, i: int) -> bytes:
    return encode(
        Frame(session=g.session, turn=g.turn, offset=off, kind="token", text=f"tok{i % 997} ",
              epoch=g.epoch, ts=time.time_ns() // 1_000_000, meta={"gen": g.gen})
    )  # fmt: skip


def _calls_for(variant: str, g: Generation, frames: list[bytes], total: int) -> list[bytes]:
    """The RESP commands of one flush of ``frames`` after ``g.offset``."""
    if variant == "floor":
        out: list[bytes] = []
        log, chan = log_key(g.session), live_channel(g.session)
        maxlen = g.publisher.maxlen
        for k, f in enumerate(frames):
            xid = f"{g.offset + k + 1}-1"
            out.append(_pack("XADD", log, "MAXLEN", "~", maxlen, xid, "f", f, "b", total))
            out.append(_pack("SPUBLISH", chan, f))
            total += len(f)
        return out
    keys, args = g.script_call(g.offset, frames)
    if variant in _NO_CLOCK:
        args = [*args[:8], *args[9:]]
    head: tuple[Any, ...]
    if variant == "before":
        head = ("EVALSHA", _sha(BEFORE_SOURCE))
    elif variant == "script_pttl":
        head = ("EVALSHA", _sha(PTTL_SOURCE))
    elif variant == "lua_floor":
        head = ("EVALSHA", _sha(LUA_FLOOR_SOURCE))
    elif variant == "script":
        head = ("EVALSHA", PUBLISH.sha)
    else:
        head = ("FCALL", FUNCTION_NAME)
    return [_pack(*head, 3, *keys, *args)]


def _pack(*args: Any) -> bytes:
    return bytes(hiredis.pack_command(cast(Any, args)))


def _sha(source: str) -> str:
    return hashlib.sha1(source.encode()).hexdigest()


async def _publish(variant: str, load: Load, batch: int, cfg: Config) -> dict[str, Any]:
    """Paced publishing of one variant; returns frames sent, replies and errors."""
    nodes = sorted(set(load.node_of))
    conns = {n: await asyncio.open_connection(n.host, n.port) for n in nodes}
    pending = dict.fromkeys(nodes, 0)
    errors: list[str] = []

    async def read(node: Addr) -> None:
        parser = hiredis.Reader()
        while chunk := await conns[node][0].read(1 << 16):
            parser.feed(chunk)
            while (r := parser.gets()) is not False:
                pending[node] -= 1
                if isinstance(r, hiredis.ReplyError):
                    errors.append(str(r)[:80])

    readers = [asyncio.create_task(read(n)) for n in nodes]
    calls_per_tick = cfg.rate * cfg.tick_s / batch
    owed, nxt, sent, i = 0.0, 0, 0, 0
    t0 = time.perf_counter()
    for t in range(int(cfg.seconds / cfg.tick_s)):
        owed += calls_per_tick
        bufs: dict[Addr, list[bytes]] = {n: [] for n in nodes}
        while owed >= 1:
            owed -= 1
            g = load.gens[nxt]
            frames = [_frame(g, g.offset + k + 1, i + k) for k in range(batch)]
            cmds = _calls_for(variant, g, frames, load.totals[nxt])
            load.totals[nxt] += sum(len(f) for f in frames)
            bufs[load.node_of[nxt]].extend(cmds)
            pending[load.node_of[nxt]] += len(cmds)
            g.offset += batch
            sent += batch
            i += batch
            nxt = (nxt + 1) % len(load.gens)
        for node, cmds in bufs.items():
            if cmds:
                conns[node][1].write(b"".join(cmds))
        delay = t0 + (t + 1) * cfg.tick_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
    took = time.perf_counter() - t0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(30):
            while any(pending.values()):
                await asyncio.sleep(0.01)
    for task in readers:
        task.cancel()
    for _, w in conns.values():
        w.close()
    return {"sent": sent, "seconds": took, "unanswered": sum(pending.values()),
            "errors": len(errors), "first_errors": sorted(set(errors))[:3]}  # fmt: skip


async def _check(redis: Any, variant: str, load: Load, sub: Subscriber | None) -> int:
    """Frames missing from a backlog or an offset, or not delivered once: their count."""
    bad = 0
    for g in load.gens:
        xlen = int(await redis.xlen(log_key(g.session)))
        off = (
            g.offset if "floor" in variant else int(await redis.hget(meta_key(g.session), "offset"))
        )
        bad += abs(xlen - g.offset) + abs(off - g.offset)
        if sub is not None:
            bad += abs(sub.got.get(live_channel(g.session).encode(), 0) - g.offset)
    return bad


async def _open(pub: Publisher, smap: SlotMap, n: int) -> Load:
    sids = sessions(n, smap, None)
    gens = list(await asyncio.gather(*(pub.open_generation(s) for s in sids)))
    node_of = []
    for g in gens:
        node = smap.node_for(slot_of(live_channel(g.session)))
        assert node is not None
        node_of.append(node)
    return Load(gens, node_of, [0] * len(gens))


async def _window(
    masters: list[Addr], replicas: list[Addr], work: Any
) -> tuple[dict[str, float], dict[str, int], Any]:
    """CPU seconds of masters and replicas and the masters' calls over ``await work``."""
    c0, k0 = await _cpu([*masters, *replicas]), await _calls(masters)
    out = await work
    await asyncio.sleep(0.2)  # the replicas apply the last of the stream
    c1, k1 = await _cpu([*masters, *replicas]), await _calls(masters)
    cpu = {
        "masters": sum(c1[n] - c0[n] for n in masters),
        "replicas": sum(c1[n] - c0[n] for n in replicas),
    }
    calls = {k: v - k0.get(k, 0) for k, v in k1.items() if v - k0.get(k, 0) > 0}
    return cpu, calls, out


# -- the run -----------------------------------------------------------------------------


_NOT_PUBLISHING = frozenset({"info", "ssubscribe", "replconf", "ping", "cluster"})


async def run(cfg: Config) -> dict[str, Any]:
    started = time.monotonic()
    load_start = Path("/proc/loadavg").read_text().split()[:3]
    rng = random.Random(cfg.seed)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        str(b): {v: [] for v in VARIANTS} for b in cfg.batches
    }
    bad = 0
    async with local_cluster(masters=3, replicas=1) as info:
        masters = [Addr(n.host, n.port) for n in info.masters]
        replicas = [Addr(n.host, n.port) for n in info.replicas]
        smap = await slotmap(masters[0])
        for node in masters:
            await raw_command(node, "SCRIPT", "LOAD", BEFORE_SOURCE)
            await raw_command(node, "SCRIPT", "LOAD", PTTL_SOURCE)
            await raw_command(node, "SCRIPT", "LOAD", LUA_FLOOR_SOURCE)
            await raw_command(node, "SCRIPT", "LOAD", PUBLISH.source)
            await raw_command(node, "FUNCTION", "LOAD", "REPLACE", function_library(PUBLISH.source))
        redis = connect(info.url)
        await redis.initialize()
        pub = Publisher(redis)
        try:
            for r in range(cfg.rounds):
                for batch in cfg.batches:
                    loads = {v: await _open(pub, smap, cfg.sessions) for v in VARIANTS}
                    sub = None
                    if cfg.subscribed:
                        sub = Subscriber()
                        chans = [live_channel(g.session) for ld in loads.values() for g in ld.gens]
                        await sub.open(smap, chans)
                    try:
                        await asyncio.sleep(0.3)
                        idle, _, _ = await _window(masters, replicas, asyncio.sleep(cfg.seconds))
                        order = list(VARIANTS)
                        rng.shuffle(order)
                        for v in order:
                            _progress(started, f"round {r + 1}/{cfg.rounds} batch {batch}: {v}")
                            cpu, calls, out = await _window(
                                masters, replicas, _publish(v, loads[v], batch, cfg)
                            )
                            missing = await _check(redis, v, loads[v], sub)
                            bad += missing + out["errors"] + out["unanswered"]
                            n = max(1, out["sent"])
                            net = {k: max(0.0, cpu[k] - idle[k] * out["seconds"] / cfg.seconds)
                                   for k in cpu}  # fmt: skip
                            per_frame = {k: v / n * 1e6 for k, v in net.items()}
                            results[str(batch)][v].append({
                                "frames": out["sent"],
                                "masters_us_per_frame": round(per_frame["masters"], 2),
                                "replicas_us_per_frame": round(per_frame["replicas"], 2),
                                "redis_us_per_frame": round(sum(per_frame.values()), 2),
                                "idle_cpu_s_subtracted": round(sum(idle.values()), 3),
                                "commands_per_frame": {
                                    k: round(c / n, 2) for k, c in sorted(calls.items())
                                    if k not in _NOT_PUBLISHING
                                },
                                "errors": out["errors"] + out["unanswered"],
                                "first_errors": out["first_errors"],
                                "missing_or_doubled": missing,
                            })  # fmt: skip
                    finally:
                        if sub is not None:
                            await sub.close()
        finally:
            await redis.aclose()
        version = info.version
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for bkey, by_v in results.items():
        summary[bkey] = {}
        for v, rounds in by_v.items():
            ratio = [
                rr["redis_us_per_frame"] / max(1e-9, fl["redis_us_per_frame"])
                for rr, fl in zip(rounds, by_v["floor"], strict=True)
            ]
            mratio = [
                rr["masters_us_per_frame"] / max(1e-9, fl["masters_us_per_frame"])
                for rr, fl in zip(rounds, by_v["floor"], strict=True)
            ]
            summary[bkey][v] = {
                "masters_us_per_frame": statistics.median(
                    x["masters_us_per_frame"] for x in rounds
                ),
                "replicas_us_per_frame": statistics.median(
                    x["replicas_us_per_frame"] for x in rounds
                ),
                "redis_us_per_frame": statistics.median(x["redis_us_per_frame"] for x in rounds),
                "x_floor": round(statistics.median(ratio), 2),
                "masters_x_floor": round(statistics.median(mratio), 2),
                "commands_per_frame": rounds[-1]["commands_per_frame"],
            }
    return {
        "summary": summary,
        "rounds": results,
        "config": asdict(cfg),
        "redis": version,
        "cpus": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": Path("/proc/loadavg").read_text().split()[:3],
        "errors": bad,
        "seconds": round(time.monotonic() - started, 1),
    }


_HEAD = ("frames/call", "variant", "Redis µs/frame", "x floor", "masters µs", "masters x floor",
         "replicas µs", "commands on the master per frame")  # fmt: skip


def _rows(res: dict[str, Any], sep: str) -> list[tuple[str, ...]]:
    """One row per batch and variant, as :func:`table` and :func:`report` print them
    (``sep`` joins the commands)."""
    rows: list[tuple[str, ...]] = []
    for batch, by_v in res["summary"].items():
        for v in VARIANTS:
            if v not in by_v:  # a run from before the variant existed
                continue
            s = by_v[v]
            cmds = sep.join(f"{k} {c:g}" for k, c in s["commands_per_frame"].items())
            rows.append((batch, v, f"{s['redis_us_per_frame']:.1f}", f"{s['x_floor']:.2f}",
                         f"{s['masters_us_per_frame']:.1f}", f"{s['masters_x_floor']:.2f}",
                         f"{s['replicas_us_per_frame']:.1f}", cmds))  # fmt: skip
    return rows


def table(res: dict[str, Any]) -> str:
    rows = [_HEAD, *_rows(res, " ")]
    w = [max(len(r[c]) for r in rows) for c in range(len(_HEAD))]
    return "\n".join("  ".join(f"{x:{w[c]}}" for c, x in enumerate(r)).rstrip() for r in rows)


def report(res: dict[str, Any]) -> str:
    """The bench/README table: :func:`table`'s rows as Markdown, with the run's load
    average under it."""
    lines = ["| " + " | ".join(_HEAD) + " |", "|" + "---|" * len(_HEAD)]
    lines += ["| " + " | ".join(r) + " |" for r in _rows(res, ", ")]
    cfg = res["config"]
    lines += ["", f"{cfg['rounds']} rounds of {cfg['seconds']:g} s per variant, "
              f"seed {cfg['seed']}, Redis {res['redis']}; {res['cpus']} CPUs, load average "
              f"{' '.join(res['loadavg_start'])} at the start, {' '.join(res['loadavg_end'])} "
              "at the end."]  # fmt: skip
    return "\n".join(lines)


@dataclass
class Flags(Common):
    seed: int = flag(0, "shuffles the variants' order")
    rounds: int = flag(Config.rounds, "rounds per variant", quick=Config.quick().rounds, least=1)
    seconds: float = flag(Config.seconds, "publishing seconds per variant",
                          quick=Config.quick().seconds, above=0)  # fmt: skip
    rate: int = flag(Config.rate, "frames/s over all sessions", quick=Config.quick().rate, least=1)
    sessions: int = flag(Config.sessions, "sessions", quick=Config.quick().sessions, least=1)
    no_subscriber: bool = flag(False, "no SSUBSCRIBEd reader")


def _run(f: Flags) -> Outcome:
    cfg = Config(sessions=f.sessions, rate=f.rate, seconds=f.seconds, rounds=f.rounds,
                 subscribed=not f.no_subscriber, seed=f.seed)  # fmt: skip
    res = asyncio.run(run(cfg))
    text = (f"{table(res)}\nload average {' '.join(res['loadavg_start'])} -> "
            f"{' '.join(res['loadavg_end'])} on {res['cpus']} CPUs (a shared machine)")  # fmt: skip
    if res["errors"]:
        print(f"publish_cost: {res['errors']} frames failed, missing or doubled", file=sys.stderr)
    return Outcome(res, text, 1 if res["errors"] else 0)


BENCH = Bench(Flags, _run, prog="python -m bench.pubsub.publish_cost", description=__doc__,
              quick_help="2 rounds of 2 s, 200 sessions", markdown=report)  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
