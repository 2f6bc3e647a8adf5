"""A soak of the Node producer: it feeds two Python relays (``tokenrelay relay``) while
many SSE viewers watch, and every frame a viewer received is checked against the
session's backlog in Redis (``XRANGE``).

What it answers: does a producer of your own, in TypeScript, deliver what the worker's
does: no frame lost, duplicated, out of order or different from the backlog's, on any
relay, for every screen. ``sessions`` sessions, ``viewers`` viewers spread evenly over
them and over the two relays (half on each), all connected before the producer starts;
the producer (``bench/producer/soak_producer.mjs``, the package with its defaults:
coalescing 8/50 ms) writes turn after turn into every session for ``duration_s``, then
each viewer is given until it holds its session's last offset. Counted (all must be 0):

* ``lost`` — offsets in the backlog a viewer never got (a relay's merged frame covers
  its range); ``duplicated``, ``out_of_order`` — from the viewers' own tallies;
* ``mismatched`` — frames a viewer got whose kind, turn, epoch or text differ from the
  backlog's frame at that offset (a merged frame: from the backlog's texts of its range);
* ``content_mismatches``, ``unended_turns``, ``viewers_behind`` — as
  :func:`bench.load.accounting.account` counts them (turn texts against the backlog and
  the ``done`` frames' sha256/chars).

Run: ``python -m bench.producer.soak [--quick] [--json PATH] [--viewers N]
[--duration-s S]``; needs node >= 18 and clients/producer's packages (``npm ci`` there),
else it is skipped with the reason (``{"skipped": ...}``).
"""

from __future__ import annotations

import asyncio
import os
import platform
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from redis.asyncio.cluster import RedisCluster

from bench._util import cpu_s, raise_nofile, run_json
from bench.harness import Bench, OnCluster, Outcome, bench_stack, flag, markdown_table
from bench.load.accounting import account, read_logs
from bench.load.viewer import Viewer
from bench.producer.cpu import ROOT, node_missing
from bench.relay.harness import SECRET, relay_process
from relay.protocol.auth import issue_token
from relay.protocol.keys import log_key, new_session_id

__all__ = ["FrameLog", "add_arguments", "check_frames", "main", "run_from_args"]

NODE_PRODUCER = ROOT / "bench" / "producer" / "soak_producer.mjs"

# what a viewer kept of one frame: (kind, turn, epoch, text, first offset it covers)
Kept = tuple[str, int, int, str, int]


class FrameLog:
    """The frames one viewer received, by offset (duplicates are the tally's to count)."""

    def __init__(self) -> None:
        self.frames: dict[int, Kept] = {}

    def on_frame(self, _viewer: Viewer, f: dict[str, Any]) -> None:
        meta = f.get("meta") or {}
        off = int(f["offset"])
        first = int(meta.get("from", off)) if "merged" in meta else off
        self.frames[off] = (f["kind"], int(f["turn"]), int(f["epoch"]), f["text"], first)


def check_frames(log: dict[int, dict[str, Any]], got: FrameLog) -> tuple[int, int, list[str]]:
    """(frames checked, frames that differ from the backlog's, a few samples). Pure."""
    checked = bad = 0
    samples: list[str] = []
    for off, (kind, turn, epoch, text, first) in got.frames.items():
        if kind in ("presence", "reset", "gap"):
            continue
        checked += 1
        ref = log.get(off)
        want = "".join(log[o]["text"] for o in range(first, off + 1) if o in log)
        if ref is None or (ref["kind"], ref["turn"], ref["epoch"]) != (kind, turn, epoch) \
                or want != text:  # fmt: skip
            bad += 1
            if len(samples) < 5:
                samples.append(f"offset {off}: got {kind}/{turn}/{epoch} {text[:20]!r}")
    return checked, bad, samples


def _one(base: str) -> Callable[[], list[str]]:
    """A viewer's relays: this one only (half the viewers on each relay)."""
    return lambda: [base]


async def _backlog(redis: RedisCluster, sid: str) -> dict[int, dict[str, Any]]:
    """The session's backlog, frame by frame, by offset (``XRANGE``)."""
    import orjson

    out: dict[int, dict[str, Any]] = {}
    for _id, fields in await redis.xrange(log_key(sid), "-", "+") or []:
        assert fields is not None
        f = orjson.loads(fields[b"f"])
        out[int(f["offset"])] = f
    return out


async def _main(args: Flags) -> dict[str, Any]:
    raise_nofile(args.viewers * 2 + 1024)
    random.seed(args.seed)
    async with bench_stack("producer-soak-") as st:
        url = await st.cluster(masters=3, replicas=0, url=args.redis)
        host, port = url.split("://", 1)[1].split(",")[0].rsplit(":", 1)
        redis = RedisCluster(host=host, port=int(port))
        st.on_exit(redis.aclose)
        log_dir = st.log_dir
        sids = [new_session_id() for _ in range(args.sessions)]
        await redis.initialize()
        async with relay_process(url, log_dir, "relay-a", args.viewers + 100) as ra, \
                relay_process(url, log_dir, "relay-b", args.viewers + 100) as rb:  # fmt: skip
            relays = [ra, rb]
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=conn) as http:
                stop = asyncio.Event()
                viewers: list[tuple[Viewer, FrameLog]] = []
                now = time.time()
                tokens = {s: issue_token(SECRET, s, 3600, now) for s in sids}
                for i in range(args.viewers):
                    sid, base = sids[i % len(sids)], relays[(i // len(sids)) % 2].base
                    fl = FrameLog()
                    v = Viewer(http, _one(base), sid, tokens[sid], on_frame=fl.on_frame)
                    viewers.append((v, fl))
                tasks = []
                for i, (v, _) in enumerate(viewers):
                    tasks.append(asyncio.create_task(v.run(stop)))
                    if i % 100 == 99:
                        await asyncio.sleep(0.2)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and any(v.connects == 0 for v, _ in viewers):
                    await asyncio.sleep(0.2)
                connected = sum(1 for v, _ in viewers if v.connects > 0)
                cpu0 = [cpu_s(r.pid) for r in relays]
                t0 = time.monotonic()
                spec = {"url": url, "sessions": sids, "duration_s": args.duration_s,
                        "rate": args.rate, "reply_min": args.reply_min, "reply_max": args.reply_max,
                        "seed": args.seed}  # fmt: skip
                produced = await run_json(
                    [shutil.which("node") or "node", str(NODE_PRODUCER)], spec,
                    name="soak-producer", timeout_s=args.duration_s + 120,
                )  # fmt: skip
                ran_s = time.monotonic() - t0
                relay_cpu = [round(cpu_s(r.pid) - c, 2) for r, c in zip(relays, cpu0, strict=True)]
                logs = await read_logs(redis, sids)
                last = {s: lg.last for s, lg in logs.items()}
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and any(
                    v.tally.last < last[v.sid] for v, _ in viewers
                ):
                    await asyncio.sleep(0.2)
                caught_up_s = time.monotonic() - t0 - ran_s
                stop.set()
                await asyncio.gather(*tasks, return_exceptions=True)
        counts = account(logs, [v for v, _ in viewers])
        backlogs = {s: await _backlog(redis, s) for s in sids}
        checked = bad = 0
        samples: list[str] = []
        for v, fl in viewers:
            c, b, sm = check_frames(backlogs[v.sid], fl)
            checked, bad = checked + c, bad + b
            samples += sm[: max(0, 5 - len(samples))]
    frames = sum(len(b) for b in backlogs.values())
    return {
        "bench": "producer_soak",
        "producer": "node (clients/producer)",
        "relays": 2,
        "sessions": args.sessions,
        "viewers": args.viewers,
        "viewers_connected_at_start": connected,
        "duration_s": round(ran_s, 1),
        "catch_up_s": round(caught_up_s, 2),
        "rate_tok_per_s_per_session": args.rate,
        "turns": produced["turns"],
        "deltas": produced["deltas"],
        "producer_errors": produced["error_count"],
        "producer_error_samples": produced["errors"],
        "producer_cpu_s": round(produced["cpu_s"], 2),
        "relay_cpu_s": relay_cpu,
        "backlog_frames": frames,
        "frames_checked": checked,
        "mismatched": bad,
        "mismatch_samples": samples,
        "lost": counts["lost"],
        "duplicated": counts["duplicated"],
        "out_of_order": counts["out_of_order"],
        "content_mismatches": counts["content_mismatches"],
        "unended_turns": counts["unended_turns"],
        "viewers_behind": counts["viewers_behind"],
        "turns_checked": counts["turns_checked"],
        "done_frames_checked": counts["done_frames_checked"],
        "reconnects": sum(max(0, v.connects - 1) for v, _ in viewers),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


@dataclass
class Flags(OnCluster):
    seed: int = flag(1, "the producer's replies")
    viewers: int = flag(1000, "SSE viewers", quick=60, least=1)
    sessions: int = flag(20, "sessions", quick=6, least=1)
    duration_s: float = flag(60.0, "producing seconds", quick=4.0, above=0)
    rate: float = flag(20.0, "deltas/s per session", above=0)
    reply_min: int = flag(20, "deltas per reply, at least", quick=10, least=1)
    reply_max: int = flag(120, "deltas per reply, at most", quick=40, least=1)


def report(r: dict[str, Any]) -> str:
    """The markdown table of a result (bench/README.md's, from its JSON)."""

    def of(*keys: str) -> str:
        return " / ".join(str(r[k]) for k in keys)

    rows = [
        ("SSE viewers / connected at start", of("viewers", "viewers_connected_at_start")),
        ("sessions / relays", of("sessions", "relays")),
        ("producing (s) / deltas/s per session", of("duration_s", "rate_tok_per_s_per_session")),
        ("turns / deltas / backlog frames", of("turns", "deltas", "backlog_frames")),
        ("frames received and checked against the backlog", of("frames_checked")),
        ("lost / duplicated / out of order", of("lost", "duplicated", "out_of_order")),
        ("mismatched frames / turn texts", of("mismatched", "content_mismatches")),
        ("unended turns / viewers behind", of("unended_turns", "viewers_behind")),
        ("producer errors / reconnects", of("producer_errors", "reconnects")),
        ("CPU s: producer / relays", of("producer_cpu_s", "relay_cpu_s")),
    ]
    return markdown_table(["", ""], rows).replace("|  |  |", "| | |", 1)


def _run(f: Flags) -> Outcome:
    why = node_missing()
    if why is not None:  # as the other benchmarks on node: skipped with the reason
        print(f"producer_soak: skipped: {why}", file=sys.stderr)
        return Outcome({"bench": "producer_soak", "skipped": why})
    out = asyncio.run(_main(f))
    keys = ("viewers", "turns", "backlog_frames", "frames_checked", "lost", "duplicated",
            "out_of_order", "mismatched", "content_mismatches", "unended_turns")  # fmt: skip
    bad = ("lost", "duplicated", "out_of_order", "mismatched", "content_mismatches",
           "unended_turns", "viewers_behind", "producer_errors")  # fmt: skip
    return Outcome(out, "  ".join(f"{k} {out[k]}" for k in keys), int(any(out[k] for k in bad)))


BENCH = Bench(Flags, _run, prog="python -m bench.producer.soak", description=__doc__,
              quick_help="a few seconds, fewer viewers", markdown=report)  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    sys.exit(main())
