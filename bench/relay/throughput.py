"""How much of a Redis connection's receive rate one relay process passes on to SSE
clients, what it adds in latency, and what an idle SSE connection costs in memory.

What it measures, all in one run, on one Redis Cluster (started here unless ``--redis``):

1. ``raw_msgs_per_s`` (the ceiling): one plain redis-py connection (``redis.asyncio.
   Redis(...).pubsub()``) SSUBSCRIBEd to the live channels of K sessions that all sit on
   one master. The reader is idle while a publisher process writes F frames per session
   (``relay.broker.rediscluster.publisher`` generations: XADD backlog + SPUBLISH in one Lua call, 50
   frames per call); the frames wait in the socket and in Redis's output buffer. Then
   the reader drains them: messages / seconds from the first read to the last message.
   Draining a backlog takes the publisher out of the measurement (it shares the 2 cores).
2. ``relay_frames_per_s``: K other sessions on the same master, F frames each, read by K SSE
   clients (1 viewer per session) of one ``tokenrelay relay`` *process*. The relay is
   stopped with SIGSTOP while the publisher writes (its shard connection buffers the
   frames exactly as the raw reader's did), then continued with SIGCONT: token frames
   received by all clients / seconds from SIGCONT to the last one.
   ``ratio`` = ``relay_frames_per_s / raw_msgs_per_s``.
3. ``fanout10_writes_per_s``: as 2, with K/10 sessions and 10 viewers per session
   (frames x viewers = writes, per second).
4. ``latency_p50_ms`` / ``latency_p99_ms``: 1,000 sessions spread over every shard, one
   SSE viewer each, a paced publisher process sending 20 tokens/s per session (20,000
   frames/s through the same Lua script, one frame per call, pipelined per node); from
   the producer's clock in the token text (ns) to the client's read of the chunk
   (same host clock). The first second is warm-up and not counted.
5. ``rss_kb_per_idle_conn``: a fresh relay process; VmRSS from ``/proc/<pid>/status``
   before and after N (10,000) idle SSE connections, each on its own session (so each
   costs a watch, a subscription and its presence entry too), divided by N.

Frames are counted by their token texts (``<19-digit ns>;``), so a conflated frame (a
slow watcher's merged token run) still counts every token: ``*_events`` in the JSON say
how many SSE events carried them. Every client checks it got every token sent (``lost``).

Processes: this one holds the raw reader and the SSE clients (raw asyncio sockets, a
regex per chunk: :mod:`bench.relay.sse_clients`); the relay runs as ``python -m tokenrelay
relay`` with its log in a temporary file (:func:`bench.relay.harness.relay_process`);
publishers run as ``python -m bench.relay.publisher SPEC``. Each is stopped by its
pid (:mod:`devstack.procs`: SIGCONT, SIGTERM, SIGKILL after 15 s); a cluster started
here is stopped by :func:`bench.harness.stack.bench_stack`. Loopback only.

Modules: this one (the run, the table, the flags), :mod:`bench.relay.ceilings` (the
redis-py and hiredis readers without a relay: phase 1 and its hiredis twin),
:mod:`bench.relay.phases` (the relay's phases: drain, latency, idle SSE and WebSocket,
replay), :mod:`bench.relay.instruments` (what reads the relay under test: ``/metrics``,
loop lag, relay view, py-spy), :mod:`bench.relay.harness` (relay process, publisher
child, CPU meter).

Phases 1-3 run ``repeats`` (3) rounds side by side (raw, relay1, fanout, raw, ...) and
report each one's median round (``rounds_per_s`` in the JSON has them all): this
machine is shared, and a neighbour's burst moves one round, rarely three.

Call order: :func:`main` (or ``python -m bench relay_throughput``) ->
:func:`add_arguments` -> :func:`run_from_args` -> :func:`run` with a :class:`Config`:
cluster -> relay A (rounds of ``raw`` / ``relay1`` / ``fanout10``, then ``latency``) ->
relay B (``idle``, a session per connection) -> relay C (``idle``, one session) ->
table and JSON. ``python -m bench.relay.throughput [--quick] [--json PATH]``.
``--phases latency5k,idle`` runs only those phases (names in :data:`PHASES`); the
figures of the others are left out of the table and the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench._util import raise_nofile
from bench.harness import Bench, OnCluster, Outcome, bench_stack, flag
from bench.relay.ceilings import raw_hiredis_phase, raw_phase
from bench.relay.harness import (
    SECRET,
    bare_process,
    relay_process,
    run_publisher,
    sessions,
    slotmap,
)
from bench.relay.instruments import summarize_profile
from bench.relay.phases import (
    Config,
    drain_phase,
    idle_phase,
    idle_ws_phase,
    latency_phase,
    median_round,
    replay_phase,
)
from relay.broker.rediscluster.nodeconn import raw_command
from relay.protocol.slotmap import Addr

__all__ = ["PHASES", "Config", "add_arguments", "main", "run", "run_from_args"]

TARGETS = {
    "ratio_hiredis": ">= 0.7",
    "fanout10_writes_per_s": ">= 5 x raw_msgs_per_s",
    "relay_cpu_us_per_frame": "<= 15",
    "latency_5k_p50_ms": "<= 1",
    "latency_5k_p99_ms": "<= 5",
    "rss_kb_per_idle_conn": "<= 15",
    "rss_kb_per_idle_ws_conn": "<= 20",
    "replay_frames_per_s": ">= 100000",
}


PHASES = (
    "raw", "hiredis", "relay1", "fanout", "latency", "latency5k", "bare",
    "idle", "idle_one", "idle_ws", "replay",
)  # fmt: skip
ROUNDS = ("raw", "hiredis", "relay1", "fanout")  # run side by side, ``repeats`` times


async def run(cfg: Config, url: str | None = None) -> dict[str, Any]:
    """The phases of ``cfg.phases`` (every one when empty) on the cluster at ``url`` (or
    on a 3+3 cluster started here)."""
    want = set(cfg.phases or PHASES)
    unknown = want - set(PHASES)
    if unknown:
        raise SystemExit(
            f"unknown phase(s) {', '.join(sorted(unknown))}; known: {', '.join(PHASES)}"
        )
    nofile = raise_nofile(cfg.idle + 1_000)
    if nofile < cfg.idle + 200:
        raise SystemExit(f"RLIMIT_NOFILE {nofile} is too low for {cfg.idle} connections")
    started = time.monotonic()
    load_start = Path("/proc/loadavg").read_text().split()[:3]
    ph: dict[str, dict[str, Any]] = {}
    logs: list[str] = []
    async with bench_stack("relay-bench-") as st:
        own = url is None
        url = await st.cluster(masters=3, replicas=1, url=url)
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        smap = await slotmap(Addr(host, int(port)))
        master = sorted({sh.master for sh in smap.slots if sh is not None})[0]
        if own:  # the drained backlog exceeds the default 32 MB pubsub output buffer
            for node in smap.nodes():
                await raw_command(
                    node, "CONFIG", "SET", "client-output-buffer-limit", "pubsub 0 0 0"
                )
        log_dir = st.log_dir

        def progress(msg: str) -> None:
            print(f"[{time.monotonic() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

        max_conn = max(cfg.sessions, cfg.lat_sessions) + 100
        if want & {*ROUNDS, "latency", "latency5k"}:
            async with relay_process(url, log_dir, "bench-relay-a", max_conn) as relay:
                rounds: dict[str, list[dict[str, Any]]] = {p: [] for p in ROUNDS if p in want}
                k = max(1, cfg.sessions // cfg.fanout)
                for i in range(cfg.repeats if rounds else 0):
                    n = f"round {i + 1}/{cfg.repeats}"
                    if "raw" in rounds:
                        progress(
                            f"{n} raw: {cfg.sessions} sessions x {cfg.frames} frames, redis-py"
                        )
                        sids = sessions(cfg.sessions, smap, master)
                        rounds["raw"].append(await raw_phase(url, master, sids, cfg))
                    if "hiredis" in rounds:
                        progress(f"{n} raw hiredis: the relay's own per-node reader alone")
                        rounds["hiredis"].append(
                            await raw_hiredis_phase(
                                url, sessions(cfg.sessions, smap, master), cfg.frames,
                                run_publisher,
                            )
                        )  # fmt: skip
                    if "relay1" in rounds:
                        progress(f"{n} relay1: {cfg.sessions} SSE clients, 1 per session")
                        sids = sessions(cfg.sessions, smap, master)
                        rounds["relay1"].append(await drain_phase(relay, url, smap, sids, 1, cfg))
                    if "fanout" in rounds:
                        progress(f"{n} fanout: {k} sessions x {cfg.fanout} viewers")
                        sids = sessions(k, smap, master)
                        rounds["fanout"].append(
                            await drain_phase(relay, url, smap, sids, cfg.fanout, cfg)
                        )
                for name, key in (("raw", "msgs_per_s"), ("hiredis", "msgs_per_s"),
                                  ("relay1", "per_s"), ("fanout", "per_s")):  # fmt: skip
                    if name in rounds:
                        ph["raw_hiredis" if name == "hiredis" else name] = median_round(
                            rounds[name], key
                        )
                if "latency" in want:
                    progress(f"latency: {cfg.lat_sessions} sessions x {cfg.lat_rate:g} tokens/s")
                    sids = sessions(cfg.lat_sessions, smap, None)
                    ph["latency"] = await latency_phase(relay, url, smap, sids, cfg)
                if "latency5k" in want:
                    cfg5k = Config(**{**asdict(cfg), "lat_rate": cfg.lat_rate_5k})
                    progress(f"latency: {cfg.lat_sessions} sessions x {cfg.lat_rate_5k:g} tokens/s")
                    prof = Path(cfg.profile) / "relay-5k.txt" if cfg.profile else None
                    sids = sessions(cfg.lat_sessions, smap, None)
                    l5 = await latency_phase(relay, url, smap, sids, cfg5k, prof)
                    if prof is not None:
                        l5["profile"] = summarize_profile(prof)
                    ph["latency_5k"] = l5
                logs.append(relay.log_path.read_text(errors="replace"))
        if "bare" in want:
            async with bare_process(url, log_dir) as bare:
                cfg5k = Config(**{**asdict(cfg), "lat_rate": cfg.lat_rate_5k})
                progress(f"bare relay: {cfg.lat_sessions} sessions x {cfg.lat_rate_5k:g} tokens/s")
                sids = sessions(cfg.lat_sessions, smap, None)
                ph["bare_5k"] = await latency_phase(bare, url, smap, sids, cfg5k, metrics=False)
                progress(f"bare relay: drain, {cfg.sessions} SSE clients, 1 per session")
                sids = sessions(cfg.sessions, smap, master)
                ph["bare_relay1"] = await drain_phase(bare, url, smap, sids, 1, cfg)
                logs.append(bare.log_path.read_text(errors="replace"))
        if "idle" in want:
            async with relay_process(url, log_dir, "bench-relay-b", cfg.idle + 100) as relay:
                progress(f"idle: {cfg.idle} idle SSE connections")
                ph["idle"] = await idle_phase(relay, smap, cfg, shared=False)
                logs.append(relay.log_path.read_text(errors="replace"))
        if "idle_one" in want:
            async with relay_process(url, log_dir, "bench-relay-c", cfg.idle + 100) as relay:
                progress(f"idle, one session: {cfg.idle} idle SSE connections on one session")
                ph["idle_one_session"] = await idle_phase(relay, smap, cfg, shared=True)
                logs.append(relay.log_path.read_text(errors="replace"))
        if "idle_ws" in want:
            async with relay_process(url, log_dir, "bench-relay-d", cfg.idle + 100) as relay:
                progress(f"idle: {cfg.idle} idle WebSocket connections")
                ph["idle_ws"] = await idle_ws_phase(
                    relay.pid, relay.port, sessions(cfg.idle + 1, smap, None), SECRET,
                    cfg.connect_window,
                )  # fmt: skip
                logs.append(relay.log_path.read_text(errors="replace"))
        if "replay" in want:
            async with relay_process(url, log_dir, "bench-relay-e", 1_000) as relay:
                progress(f"replay: {cfg.replay_frames} frames from 0 x {cfg.replay_clients} SSE")
                ph["replay"] = await replay_phase(
                    url, relay.pid, relay.port, sessions(1, smap, None)[0], SECRET,
                    cfg.replay_frames, cfg.replay_clients,
                )  # fmt: skip
                logs.append(relay.log_path.read_text(errors="replace"))
    res = _figures(ph)
    res.update({
        "config": asdict(cfg),
        "cluster": "started here (3 masters + 3 replicas)" if own else url,
        "cpus": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": Path("/proc/loadavg").read_text().split()[:3],
        "phases": ph,
        "relay_log_tracebacks": sum(text.count("Traceback") for text in logs),
        "targets": TARGETS,
        "seconds": round(time.monotonic() - started, 1),
    })  # fmt: skip
    res["targets_met"] = _targets_met(res)
    return res


def _figures(ph: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The headline figures of the phases that ran (a figure whose phases did not run
    is left out)."""
    res: dict[str, Any] = {}
    raw_rate = ph["raw"]["msgs_per_s"] if "raw" in ph else 0
    hi_rate = ph["raw_hiredis"]["msgs_per_s"] if "raw_hiredis" in ph else 0
    if "raw" in ph:
        res["raw_msgs_per_s"] = raw_rate
    if "raw_hiredis" in ph:
        res["raw_hiredis_msgs_per_s"] = hi_rate
    if "relay1" in ph:
        r1 = ph["relay1"]["per_s"]
        res["relay_frames_per_s"] = r1
        if "raw" in ph:
            res["ratio"] = round(r1 / raw_rate, 3) if raw_rate else 0.0
        if "raw_hiredis" in ph:
            res["ratio_hiredis"] = round(r1 / hi_rate, 3) if hi_rate else 0.0
    if "latency_5k" in ph:
        res["relay_cpu_us_per_frame"] = ph["latency_5k"]["relay_cpu_us_per_frame"]
    if "fanout" in ph:
        fo = ph["fanout"]
        res["fanout10_writes_per_s"] = fo["per_s"]
        relay_cpu = fo["cpu_while_draining"]["relay_cpu_s"]
        if relay_cpu > 0:  # what the relay itself would carry with a core to itself
            res["fanout10_writes_per_relay_cpu_s"] = round(fo["received"] / relay_cpu)
    if "latency" in ph:
        res["latency_p50_ms"] = ph["latency"]["p50_ms"]
        res["latency_p99_ms"] = ph["latency"]["p99_ms"]
    if "latency_5k" in ph:
        res["latency_5k_p50_ms"] = ph["latency_5k"]["p50_ms"]
        res["latency_5k_p99_ms"] = ph["latency_5k"]["p99_ms"]
        res["loop_max_turn_ms_5k"] = ph["latency_5k"]["relay_loop_lag"]["max_ms_at_most"]
    if "bare_relay1" in ph:
        res["bare_frames_per_s"] = ph["bare_relay1"]["per_s"]
        if "raw_hiredis" in ph:
            res["bare_ratio_hiredis"] = (
                round(res["bare_frames_per_s"] / hi_rate, 3) if hi_rate else 0.0
            )
    if "bare_5k" in ph:
        b5 = ph["bare_5k"]
        res["bare_cpu_us_per_frame"] = b5["relay_cpu_us_per_frame"]
        res["bare_latency_5k_p50_ms"] = b5["p50_ms"]
        res["bare_latency_5k_p99_ms"] = b5["p99_ms"]
        if "latency_5k" in ph and b5["relay_cpu_us_per_frame"]:
            res["relay_cpu_vs_bare"] = round(
                ph["latency_5k"]["relay_cpu_us_per_frame"] / b5["relay_cpu_us_per_frame"], 2
            )
    if "latency" in ph:
        res["loop_max_turn_ms_20k"] = ph["latency"]["relay_loop_lag"]["max_ms_at_most"]
    if "idle" in ph:
        res["rss_kb_per_idle_conn"] = ph["idle"]["kb_per_conn"]
    if "idle_ws" in ph:
        res["rss_kb_per_idle_ws_conn"] = ph["idle_ws"]["kb_per_conn"]
    if "replay" in ph:
        res["replay_frames_per_s"] = ph["replay"]["frames_per_s"]
        res["replay_rss_peak_mb"] = round(ph["replay"]["rss_peak_kb"] / 1024, 1)
    if "idle_one_session" in ph:
        res["rss_kb_per_idle_conn_one_session"] = ph["idle_one_session"]["kb_per_conn"]
    if "relay1" in ph and "raw" in ph:
        res["ratio_per_round"] = [
            round(a / b, 3) if b else 0.0
            for a, b in zip(ph["relay1"]["rounds_per_s"], ph["raw"]["rounds_per_s"], strict=True)
        ]
    if "fanout" in ph and "raw" in ph:
        res["fanout_vs_raw"] = round(ph["fanout"]["per_s"] / raw_rate, 2) if raw_rate else 0.0
    return res


def _targets_met(res: dict[str, Any]) -> dict[str, bool]:
    """Each target whose figure was measured: met or not."""
    checks: dict[str, Callable[[float], bool]] = {
        "ratio_hiredis": lambda v: v >= 0.7,
        "fanout10_writes_per_s": lambda v: (
            "raw_msgs_per_s" in res and v >= 5 * res["raw_msgs_per_s"]
        ),
        "relay_cpu_us_per_frame": lambda v: 0 < v <= 15.0,
        "latency_5k_p50_ms": lambda v: v <= 1.0,
        "latency_5k_p99_ms": lambda v: v <= 5.0,
        "rss_kb_per_idle_conn": lambda v: v <= 15.0,
        "rss_kb_per_idle_ws_conn": lambda v: v <= 20.0,
        "replay_frames_per_s": lambda v: v >= 100_000,
    }
    return {k: bool(check(res[k])) for k, check in checks.items() if k in res}


def _table(res: dict[str, Any]) -> str:
    """One row per figure measured: value, target (met or not) and what it is of."""
    ph = res["phases"]
    met = res["targets_met"]
    r1, fo, la, l5 = (ph.get(k, {}) for k in ("relay1", "fanout", "latency", "latency_5k"))
    b5 = ph.get("bare_5k", {})
    idle, ws, rp = (ph.get(k, {}) for k in ("idle", "idle_ws", "replay"))

    def cpu(p: dict[str, Any]) -> str:
        c = p["cpu"]
        return (
            f"CPU s relay {c['relay_cpu_s']}, redis {c['redis_cpu_s']}, publisher"
            f" {c['publisher_cpu_s']}, clients {c['loadgen_cpu_s']}, others {c['other_cpu_s']}"
            f" of {c['machine_capacity_cpu_s']}"
        )

    # fmt: off
    details: dict[str, Callable[[], str]] = {
        "raw_msgs_per_s": lambda: f"redis-py PubSub, {ph['raw']['received']:,} msgs",
        "raw_hiredis_msgs_per_s": lambda: f"the relay's per-node hiredis reader alone, lost {ph['raw_hiredis']['lost']}",  # noqa: E501
        "relay_frames_per_s": lambda: f"{r1['clients']:,} SSE clients, lost {r1['lost']}",
        "ratio": lambda: "relay / redis-py",
        "ratio_hiredis": lambda: "relay / hiredis reader",
        "relay_cpu_us_per_frame": lambda: f"at {l5['offered_frames_per_s']:,} frames/s, 1 viewer per session",  # noqa: E501
        "fanout10_writes_per_s": lambda: f"{res.get('fanout_vs_raw', '?')}x raw, {fo['sessions']} x {fo['viewers_per_session']}, lost {fo['lost']}; CPU s relay {fo['cpu_while_draining']['relay_cpu_s']}, clients {fo['cpu_while_draining']['loadgen_cpu_s']} in {fo['cpu_while_draining']['wall_s']} s",  # noqa: E501
        "fanout10_writes_per_relay_cpu_s": lambda: "writes per relay CPU-second in the fanout phase (its rate with a core to itself, at that cost per write)",  # noqa: E501
        "latency_p50_ms": lambda: f"{la['offered_frames_per_s']:,} frames/s offered",
        "latency_p99_ms": lambda: f"max {la['max_ms']} ms, behind {la['lag_after_publisher_s']} s, lost {la['lost']}; {cpu(la)}",  # noqa: E501
        "latency_5k_p50_ms": lambda: f"{l5['offered_frames_per_s']:,} frames/s offered",
        "latency_5k_p99_ms": lambda: f"max {l5['max_ms']} ms, behind {l5['lag_after_publisher_s']} s, lost {l5['lost']}; {cpu(l5)}",  # noqa: E501
        "loop_max_turn_ms_5k": lambda: f"{l5['relay_loop_lag']['over_1ms']} of {l5['relay_loop_lag']['samples']} 10 ms timer samples > 1 ms late",  # noqa: E501
        "loop_max_turn_ms_20k": lambda: f"{la['relay_loop_lag']['over_1ms']} of {la['relay_loop_lag']['samples']} samples > 1 ms late",  # noqa: E501
        "bare_frames_per_s": lambda: f"the bare relay drained like relay1, {ph['bare_relay1']['clients']:,} SSE clients, lost {ph['bare_relay1']['lost']}",  # noqa: E501
        "bare_ratio_hiredis": lambda: "bare relay / hiredis reader",
        "bare_cpu_us_per_frame": lambda: f"the least a relay does (bench.relay.bare), same load; {cpu(b5)}",  # noqa: E501
        "relay_cpu_vs_bare": lambda: "relay_cpu_us_per_frame / bare_cpu_us_per_frame",
        "bare_latency_5k_p50_ms": lambda: "the bare relay, same publisher, clients and rate",
        "bare_latency_5k_p99_ms": lambda: f"max {b5['max_ms']} ms, behind {b5['lag_after_publisher_s']} s, lost {b5['lost']}",  # noqa: E501
        "rss_kb_per_idle_conn": lambda: f"{idle['connections']:,} SSE conns, 1 session each",
        "rss_kb_per_idle_ws_conn": lambda: f"{ws['connections']:,} WebSocket conns, 1 session each",
        "replay_frames_per_s": lambda: f"{rp['clients']} SSE clients x {rp['frames']:,} frames from 0: {rp['endings']}",  # noqa: E501
        "replay_rss_peak_mb": lambda: f"relay VmHWM; {rp['rss_before_kb'] // 1024} MB before the replay",  # noqa: E501
    }
    # fmt: on
    rows = []
    for key, detail in details.items():
        if key not in res:
            continue
        target = TARGETS.get(key, "")
        if target and key in met:
            target += ": met" if met[key] else ": NOT met"
        value = res[key]
        rows.append((key, f"{value:,}" if isinstance(value, int) else str(value), target, detail()))
    if not rows:
        return "no figure (no phase ran)"
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{'figure':{w[0]}}  {'value':>{w[1]}}  {'target':{w[2]}}  detail"]
    lines += [f"{a:{w[0]}}  {b:>{w[1]}}  {c:{w[2]}}  {d}" for a, b, c, d in rows]
    return "\n".join(lines)


_D, _Q = Config(), Config.quick()


@dataclass
class Flags(OnCluster):
    sessions: int = flag(_D.sessions, "K, flood sessions = clients", quick=_Q.sessions, least=1)
    frames: int = flag(_D.frames, "F, frames per session in the flood", quick=_Q.frames, least=1)
    lat_sessions: int = flag(_D.lat_sessions, "sessions in the latency phase", least=1)
    lat_seconds: float = flag(_D.lat_seconds, "measured seconds of the latency phase",
                              quick=_Q.lat_seconds, above=0)  # fmt: skip
    lat_rate: float = flag(_D.lat_rate, "tokens/s per session in the latency phase", above=0)
    lat_tick_ms: float = flag(_D.lat_tick_ms, "the paced publisher's tick: each tick's share of "
                              "the sessions goes out in one write per master", above=0)  # fmt: skip
    lat_stamp: str = flag(_D.lat_stamp, "paced frames carry the time their tick's write is "
                          "handed to the socket (send) or the time each was made (build: the "
                          "method before the bare relay)", choices=("send", "build"))  # fmt: skip
    idle: int = flag(_D.idle, "idle SSE connections", quick=_Q.idle, least=0)
    profile: str = flag("", "sample the relay with py-spy in the 5,000/s phase", metavar="DIR")
    profile_native: bool = flag(False, "with --profile: C frames and system calls too (py-spy "
                                "--native; it pauses the relay for each sample)")  # fmt: skip
    phases: str = flag("", f"run only these phases, comma-separated (default: all): "
                       f"{','.join(PHASES)}", metavar="LIST")  # fmt: skip


def config_from_args(args: argparse.Namespace | Flags) -> Config:
    f = args if isinstance(args, Flags) else BENCH.flags(args)
    cfg = Config.quick() if f.quick else Config()
    for name in ("sessions", "frames", "lat_sessions", "lat_rate", "lat_seconds", "lat_tick_ms",
                 "lat_stamp", "idle", "profile", "profile_native"):  # fmt: skip
        setattr(cfg, name, getattr(f, name))
    cfg.phases = tuple(p.strip() for p in f.phases.split(",") if p.strip())
    return cfg


def _run(f: Flags) -> Outcome:
    res = asyncio.run(run(config_from_args(f), f.redis))
    ph = res["phases"]
    lost = sum(
        ph[k]["lost_all_rounds"] for k in ("raw", "raw_hiredis", "relay1", "fanout") if k in ph
    )
    lost += sum(
        ph[k]["lost"] for k in ("latency", "latency_5k", "bare_5k", "bare_relay1") if k in ph
    )
    return Outcome(res, _table(res), 1 if lost or res["relay_log_tracebacks"] else 0)


BENCH = Bench(
    Flags,
    _run,
    uvloop=True,
    prog="python -m bench.relay.throughput",
    description=__doc__,
    quick_help="400 sessions, 4 s latency, 2,000 idle",
)
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
