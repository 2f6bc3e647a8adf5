"""The whole path's CPU per delivered token, tokenrelay beside its peers, in one run.

On one local 3 + 3 Redis Cluster, every system (:mod:`bench.peers.pathdrivers`:
tokenrelay over WebSocket, Socket.IO with its sharded adapter, tokenrelay over SSE and the
bare relay for the relay-vs-bare ratio; ``resumable-stream`` from
:mod:`bench.peers.resumable` when that module exists, else named as missing) runs every
phase it supports (after one discarded warm-up round each), the systems alternating round
by round (the order shuffled by ``--seed``, reversed every other round), each round on
fresh sessions:

- ``1000x1_<rate>``: 1,000 sessions x 1 reader, ``rate`` tokens/s in all (2,000, 5,000,
  10,000);
- ``100x10_2000``: 100 sessions x 10 readers, 2,000 tokens/s published (20,000
  deliveries/s);
- ``storm_1000x1_2000``: as ``1000x1_2000``, and once half the tokens arrived every
  reader drops and reconnects at once (resuming where the system can).

Per system and phase, medians of the rounds (:func:`bench.peers.pathaims.summarize`): CPU
per delivered token over the whole path (producer + every Redis node + the server) with
each participant's share, p50 / p99 producer-to-screen, whether it kept up, lost and
duplicated (tokenrelay's against the backlog in Redis); then the aims' ratios
(:func:`bench.peers.pathaims.aims`) and each system's guarantee. ``--profile DIR`` samples
the relay with py-spy in one more round of the fastest one-reader phase and of the storm.

``python -m bench.peers.pathcost [--quick] [--json PATH] [--seed N]``;
``python -m bench.peers.pathcost --report PATH.json`` prints the markdown of bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench._util import raise_nofile
from bench.harness import Bench as Harness
from bench.harness import OnCluster, Outcome, bench_stack, flag
from bench.harness.report import progress as _progress
from bench.peers.centrifugo import PIN as CENTRIFUGO_PIN
from bench.peers.centrifugo import ensure_centrifugo
from bench.peers.llmshape import mean_rate
from bench.peers.node import ensure_socketio, installed_versions
from bench.peers.pathaims import aims, summarize
from bench.peers.pathdrivers import Bench, CentrifugoSystem, RelaySystem, SocketIOSystem
from bench.peers.pathround import redis_cpu_by_role
from bench.peers.pathsystem import Phase, RoundFigures, System
from bench.relay.harness import slotmap
from bench.relay.instruments import profiled, summarize_profile
from relay.protocol.slotmap import Addr

__all__ = ["Config", "add_arguments", "main", "phases", "report", "run", "run_from_args"]

TURN_TOKENS = 300  # a real turn's length, for a turn's opening per token in --report
ALL = ("tokenrelay", "socketio", "socketio-streams", "centrifugo", "resumable-stream",
       "tokenrelay-sse", "bare")  # fmt: skip


@dataclass
class Config:
    sessions: int = 1_000
    rates: tuple[int, ...] = (2_000, 5_000, 10_000)  # tokens/s over all sessions
    fan_sessions: int = 100
    fan_viewers: int = 10
    fan_rate: int = 2_000
    storm_sessions: int = 1_000
    storm_rate: int = 2_000
    # the LLM-rate phases (bench.peers.llmshape): tokens/s of each replying session
    llm_rates: tuple[int, ...] = (30, 60, 100)
    llm_sessions: int = 400  # live sessions, 1 screen each (about 1 in 8 replying at once)
    llm_fan_sessions: int = 100  # with llm_fan_viewers screens each, at 60 tokens/s
    llm_fan_viewers: int = 10
    llm_storm_rate: int = 60
    coalesce: tuple[int, float] = (8, 0.05)  # tokenrelay's flush size and window (s)
    seconds: float = 8.0
    warm_s: float = 1.0
    repeats: int = 3
    systems: tuple[str, ...] = ALL
    only: tuple[str, ...] = ()  # phase names to run (empty: every phase)
    custom: tuple[Phase, ...] = ()  # these instead of the phases above (pathscale)
    masters: int = 3  # of the cluster started here (each with one replica)
    seed: int = 0
    profile: str | None = None
    notes: dict[str, str] = field(default_factory=dict)

    @classmethod
    def quick(cls) -> Config:
        return cls(seconds=3.0, repeats=1)


def phases(cfg: Config) -> list[Phase]:
    if cfg.custom:
        return [p for p in cfg.custom if not cfg.only or p.name in cfg.only]
    out = [Phase(f"{cfg.sessions}x1_{r}", cfg.sessions, 1, r, cfg.seconds) for r in cfg.rates]
    out.append(Phase(f"{cfg.fan_sessions}x{cfg.fan_viewers}_{cfg.fan_rate}", cfg.fan_sessions,
                     cfg.fan_viewers, cfg.fan_rate, cfg.seconds))  # fmt: skip
    out.append(Phase(f"storm_{cfg.storm_sessions}x1_{cfg.storm_rate}", cfg.storm_sessions, 1,
                     cfg.storm_rate, cfg.seconds, "resume_storm"))  # fmt: skip
    for r in cfg.llm_rates:
        out.append(Phase(f"llm{r}_{cfg.llm_sessions}x1", cfg.llm_sessions, 1,
                         round(mean_rate(cfg.llm_sessions, r)), cfg.seconds, "llm", r))  # fmt: skip
    fan, r, n = cfg.llm_fan_sessions, cfg.llm_storm_rate, cfg.llm_sessions
    out.append(Phase(f"llm{r}_{fan}x{cfg.llm_fan_viewers}", fan, cfg.llm_fan_viewers,
                     round(mean_rate(fan, r)), cfg.seconds, "llm", r))  # fmt: skip
    out.append(Phase(f"llm{r}_storm_{n}x1", n, 1, round(mean_rate(n, r)), cfg.seconds,
                     "llm_storm", r))  # fmt: skip
    return [p for p in out if p.name in cfg.only] if cfg.only else out


def _resumable(bench: Bench) -> System | str:
    """The resumable-stream system on the run's cluster (through a cluster client), or why
    there is none."""
    try:
        from bench.peers.resumable import ResumableStream
    except ImportError as exc:
        return f"its driver (bench/peers/resumable.py) does not import: {exc}"
    return ResumableStream(bench.url, bench.log_dir, mode="cluster", warm_s=bench.warm_s)


def _systems(cfg: Config, bench: Bench) -> tuple[dict[str, System], dict[str, str]]:
    made: dict[str, System] = {}
    missing: dict[str, str] = {}
    for name in cfg.systems:
        if name == "tokenrelay":
            made[name] = RelaySystem(bench, "ws")
        elif name == "tokenrelay-sse":
            made[name] = RelaySystem(bench, "sse")
        elif name == "bare":
            made[name] = RelaySystem(bench, bare=True)
        elif name in ("socketio", "socketio-streams"):
            if bench.modules is None:
                missing[name] = cfg.notes.get("socketio", "node_modules missing")
            else:
                made[name] = SocketIOSystem(bench, streams=name == "socketio-streams")
        elif name == "centrifugo":
            if bench.centrifugo is None:
                missing[name] = cfg.notes.get("centrifugo", "not built")
            else:
                made[name] = CentrifugoSystem(bench)
        elif name == "resumable-stream":
            got = _resumable(bench)
            if isinstance(got, str):
                missing[name] = got
            else:
                made[name] = got
        else:
            raise ValueError(f"unknown system {name!r} (one of {', '.join(ALL)})")
    return made, missing


def _supports(system: System, phase: Phase) -> bool:
    check = getattr(system, "supports", None)
    return bool(check(phase)) if callable(check) else True


async def run(cfg: Config, url: str | None = None) -> dict[str, Any]:
    started = time.monotonic()
    sio = {"socketio", "socketio-streams"} & set(cfg.systems)
    got = await asyncio.to_thread(ensure_socketio) if sio else None
    modules = got if isinstance(got, Path) else None
    if isinstance(got, str):
        cfg.notes["socketio"] = got
    built = await asyncio.to_thread(ensure_centrifugo) if "centrifugo" in cfg.systems else None
    if isinstance(built, str):
        cfg.notes["centrifugo"] = built
    plan = phases(cfg)
    readers = max((p.sessions * p.viewers for p in plan), default=1)
    raise_nofile(4 * readers + 1_000)
    load_start = Path("/proc/loadavg").read_text().split()[:3]
    results: dict[str, dict[str, Any]] = {p.name: {} for p in plan}
    profile: dict[str, list[dict[str, Any]]] = {}
    redis_idle: dict[str, float] = {}
    failed: dict[str, dict[str, str]] = {}  # phase -> peer -> why its round failed
    async with bench_stack("pathcost-") as st:
        own = url is None
        url = await st.cluster(masters=cfg.masters, replicas=1, url=url)
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        seed = Addr(host, int(port))
        log_dir = st.log_dir
        bench = Bench(url, seed, await slotmap(seed), log_dir, modules, readers + 100, cfg.warm_s,
                      built if isinstance(built, Path) else None, cfg.coalesce)  # fmt: skip
        systems, missing = _systems(cfg, bench)
        for name, system in list(systems.items()):
            try:
                await system.start()
            except Exception as exc:  # a peer that cannot start is named, not fatal
                missing[name] = f"did not start: {exc!r}"[:300]
                del systems[name]
            else:
                st.on_exit(system.stop)
        order = list(systems)
        random.Random(cfg.seed).shuffle(order)
        warm = Phase("warm-up", min(100, cfg.sessions), 1, min(200, cfg.rates[0]), 2.0)
        for name in order:  # first connections, imports, caches: left out of the figures
            _progress(started, f"warm-up: {name}")
            await systems[name].round(warm, cfg.seed)
        r0, t0 = await redis_cpu_by_role(bench.smap), time.perf_counter()
        await asyncio.sleep(3.0)  # every system started, no round: Redis's own floor
        r1, span = await redis_cpu_by_role(bench.smap), time.perf_counter() - t0
        redis_idle = {k: round((r1[k] - r0[k]) / span, 4) for k in r0}
        for phase in plan:
            rounds: dict[str, list[RoundFigures]] = {k: [] for k in order}
            for i in range(cfg.repeats):
                for name in order if i % 2 == 0 else order[::-1]:
                    if not _supports(systems[name], phase):
                        continue
                    _progress(started, f"{phase.name} round {i + 1}/{cfg.repeats}: {name}")
                    try:
                        rounds[name].append(await systems[name].round(phase, cfg.seed + i))
                    except Exception as exc:  # a peer's failed round is named, not fatal
                        if name.startswith("tokenrelay"):
                            raise
                        failed.setdefault(phase.name, {})[name] = f"{exc!r}"[:300]
            results[phase.name] = {k: summarize(v) for k, v in rounds.items() if v}
        if cfg.profile and "tokenrelay" in systems:
            profile = await _profile(cfg, plan, systems["tokenrelay"], Path(cfg.profile), started)
        logs = "".join(p.read_text(errors="replace") for p in log_dir.glob("*.log"))
    by_name = {p.name: p for p in plan}
    versions = installed_versions(modules) if modules else {}
    if isinstance(built, Path):
        versions["centrifugo"] = CENTRIFUGO_PIN
    return {
        "phases": {p.name: asdict(p) for p in plan},
        "results": results,
        "aims": aims(by_name, results, missing, cfg.coalesce[1] * 1e3),
        "guarantees": {n: s.guarantee for n, s in systems.items()},
        "missing": missing,
        "failed_rounds": failed,
        "redis_idle_cpu_s_per_s": redis_idle,
        "profile": profile,
        "order": order,
        "config": asdict(cfg),
        "versions": {"python": sys.version.split()[0], **versions},
        "cluster": f"started here ({cfg.masters} masters + {cfg.masters} replicas)" if own else url,
        "cpus": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": Path("/proc/loadavg").read_text().split()[:3],
        "server_log_tracebacks": logs.count("Traceback"),
        "seconds": round(time.monotonic() - started, 1),
    }


async def _profile(
    cfg: Config, plan: list[Phase], system: System, out: Path, started: float
) -> dict[str, list[dict[str, Any]]]:
    """py-spy on the relay over one more round of the fastest one-reader phase, and of
    the resume storm; each phase's functions by self share."""
    steady = sorted((p for p in plan if p.viewers == 1 and p.kind == "steady"),
                    key=lambda p: p.tokens_per_s)[-1:]  # fmt: skip
    server = getattr(system, "server", None)
    if server is None:
        return {}
    out.mkdir(parents=True, exist_ok=True)
    got: dict[str, list[dict[str, Any]]] = {}
    for phase in [*steady, *(p for p in plan if p.kind == "resume_storm")]:
        path = out / f"pathcost-relay-{phase.name}.txt"
        _progress(started, f"profile: py-spy on the relay, {phase.name}")
        async with profiled(server.pid, path, phase.seconds + 3):
            await system.round(phase, cfg.seed)
        got[phase.name] = summarize_profile(path)
    return got


# -- tables --------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.2f}"
    return str(v)


def _target(t: Any) -> str:
    if isinstance(t, bool):
        return "yes"
    return f"<= {t:g}" if isinstance(t, (int, float)) else str(t)


def _md(head: tuple[str, ...], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _commands_md(res: dict[str, Any], n: int = 6) -> list[str]:
    """Redis's busiest commands per phase and system (INFO commandstats, by role): µs and
    calls per delivered token, medians of the rounds."""
    rows = []
    for name, by_sys in res["results"].items():
        for sysname, r in by_sys.items():
            cmds = r.get("redis_commands") or []
            if cmds:
                top = ", ".join(f"{c['role'][0]}:{c['command']} {c['us_per_token']:.2f}"
                                f" (x{c['calls_per_token']:.3g})" for c in cmds[:n])  # fmt: skip
                opens = [float(x["notes"]["open_redis_us_per_turn"]) for x in r["rounds"]
                         if "open_redis_us_per_turn" in x.get("notes", {})]  # fmt: skip
                op = "-"
                if opens:
                    per = statistics.median(opens)
                    op = f"{per:.0f} ({per / TURN_TOKENS:.2f})"
                rows.append((name, sysname, f"{r['us_per_token'].get('redis', 0.0):.1f}", op,
                             top))  # fmt: skip
    if not rows:
        return []
    head = ("phase", "system", "Redis µs/token (INFO cpu)",
            f"turn's opening, Redis µs (per token of a {TURN_TOKENS}-token turn)",
            "busiest commands: m(asters)/r(eplicas):command µs/token (calls/token)")  # fmt: skip
    return [_md(head, rows), "",
            "Commands' own time (INFO commandstats) sums below INFO cpu: the event loop, "
            "reading and writing sockets and replication are outside it. A command a "
            "script runs counts under its own name and inside the script's evalsha/eval. "
            "A turn's opening (one generation per session) runs before the window and is "
            "counted per turn: a round's turn is its few seconds, a real one a few hundred "
            "tokens.", ""]  # fmt: skip


def _llm_md(res: dict[str, Any]) -> list[str]:
    """The LLM-rate phases' extras: tokens and frames per round, tokenrelay's coalescing
    (frames per token, the mean and longest wait a token had in the coalescer), and the
    screens each system recovered in a storm (medians of the rounds)."""
    rows = []
    for name, by_sys in res["results"].items():
        if not res["phases"][name]["kind"].startswith("llm"):
            continue
        for sysname, r in by_sys.items():
            notes = [x["notes"] for x in r["rounds"]]

            def med(key: str, notes: list[dict[str, Any]] = notes) -> str:
                got = [float(n[key]) for n in notes if key in n]
                return f"{statistics.median(got):,.2f}" if got else "-"

            frames = [float(n["coalesce_frames"]) / max(float(x["published"]), 1.0)
                      for n, x in zip(notes, r["rounds"], strict=True)
                      if "coalesce_frames" in n]  # fmt: skip
            rows.append((name, sysname, f"{r['published']:,.0f}",
                         f"{statistics.median(frames):.2f}" if frames else "1 (none)",
                         med("coalesce_wait_ms_mean"), med("coalesce_wait_ms_max"),
                         med("storm_recovered"), med("storm_reconnect_s"),
                         med("readers_cpu_share")))  # fmt: skip
    if not rows:
        return []
    n, window = res["config"]["coalesce"]
    head = ("phase", "system", "tokens published", "frames per token",
            "coalescer wait, mean ms", "max ms", "screens recovered (storm)",
            "storm reconnect s", "readers' CPU share")  # fmt: skip
    return [_md(head, rows), "",
            f"tokenrelay's coalescing in these phases: a frame at {n} tokens or after "
            f"{window * 1e3:g} ms, the first token of a reply at once (the worker's "
            "TokenPump policy); its wait is inside tokenrelay's latency above. The peers "
            "publish one message per token. The readers' CPU share is the bench process's "
            "(every screen's client) CPU seconds per second over the window: near 1 its one "
            "core, not the system under test, sets the latency.", ""]  # fmt: skip


def report(res: dict[str, Any]) -> str:
    """The markdown of bench/README.md: figures, aims, guarantees, what was missing."""
    head = ("phase", "system", "µs/token whole", "producer", "Redis", "server", "p50 ms",
            "p99 ms", "kept up", "lost", "dup")  # fmt: skip
    rows = []
    for name, by_sys in res["results"].items():
        for sysname, r in by_sys.items():
            us, sh = r["us_per_token"], r["shares"]
            part = [f"{us[k]:.1f} ({sh[k]:.0%})" if k in us else "-"
                    for k in ("producer", "redis", "server")]  # fmt: skip
            rows.append((name, sysname, f"{us['whole']:.1f}", *part, _fmt(r["p50_ms"]),
                         _fmt(r["p99_ms"]), _fmt(r["kept_up"]), str(r["lost"]),
                         str(r["duplicated"])))  # fmt: skip
    out = [_md(head, rows), ""]
    # the aims again from the run's figures (pure), so a saved run reads as this code judges
    plan = {n: Phase(**p) for n, p in res["phases"].items()}
    judged = aims(plan, res["results"], res["missing"], res["config"]["coalesce"][1] * 1e3)
    aim_rows = [(a["phase"], a["aim"], _fmt(a["ours"]), _fmt(a["theirs"]), _fmt(a["ratio"]),
                 _target(a["target"]),
                 _fmt(a["met"]), a["missed_by"] or "") for a in judged]  # fmt: skip
    out += [_md(("phase", "aim", "tokenrelay", "peer", "ratio", "target", "met", "missed by"),
                aim_rows), ""]  # fmt: skip
    out += _commands_md(res)
    out += _llm_md(res)
    out += [f"- **{n}**: {g}" for n, g in res["guarantees"].items()]
    out += [f"- **{n}**: not in this run: {why}" for n, why in res["missing"].items()]
    failed = res.get("failed_rounds") or {}
    out += [f"- **{n}** in {ph}: its round failed: {why}"
            for ph, by in failed.items() for n, why in by.items()]  # fmt: skip
    prof = res.get("profile") or {}
    for phase, funcs in prof.items() if isinstance(prof, dict) else [("", prof)]:
        top = ", ".join(f"{p['function']} {p['self_pct']}%" for p in funcs[:8])
        name = f" {phase}" if phase else ""
        out += ["", f"Relay profile{name} (py-spy, self share of busy samples): {top}"]
    idle = res.get("redis_idle_cpu_s_per_s")
    if idle:
        total = sum(idle.values())
        rate = min(res["config"]["rates"])
        out += ["", f"Redis with every system started and no round running: {total:.3f} CPU "
                f"s/s over its 6 nodes (masters {idle['masters']:.3f}, replicas "
                f"{idle['replicas']:.3f}): {total * 1e6 / rate:.1f} µs per token at "
                f"{rate:,} tokens/s, inside every system's Redis share above."]  # fmt: skip
    c = res["config"]
    out += ["", f"{c['repeats']} rounds of {c['seconds']:g} s per system and phase, order "
            f"{', '.join(res['order'])}; {res['cpus']} CPUs, load {' '.join(res['loadavg_start'])}"
            f" at the start, {' '.join(res['loadavg_end'])} at the end."]  # fmt: skip
    return "\n".join(out)


# -- command line --------------------------------------------------------------------------


_D, _Q = Config(), Config.quick()


@dataclass
class Flags(OnCluster):
    seed: int = flag(0, "picks the order of the systems")
    seconds: float = flag(_D.seconds, "publishing seconds per round", quick=_Q.seconds)
    repeats: int = flag(_D.repeats, "rounds per system and phase", quick=_Q.repeats)
    systems: str = flag("", f"comma-separated, of {','.join(ALL)} (all)")
    phases: str = flag("", "comma-separated phase names (all): "
                       + ",".join(p.name for p in phases(_D)))  # fmt: skip
    profile: str | None = flag(None, "py-spy the relay in one more round", metavar="DIR")
    llm_sessions: int = flag(_D.llm_sessions, "live sessions of the 1-screen LLM-rate phases")
    coalesce: str = flag("8,50", "tokenrelay's coalescing in the LLM-rate phases: flush "
                         "size (tokens) and window (ms)", metavar="N,MS")  # fmt: skip


def config_from_args(args: argparse.Namespace | Flags) -> Config:
    f = args if isinstance(args, Flags) else BENCH.flags(args)
    cfg = Config(seed=f.seed, seconds=f.seconds, repeats=f.repeats, profile=f.profile,
                 llm_sessions=f.llm_sessions)  # fmt: skip
    try:
        n, ms = (float(x) for x in f.coalesce.split(","))
    except ValueError:
        raise SystemExit(
            f"pathcost: --coalesce wants N,MS (e.g. 8,50), got {f.coalesce!r}"
        ) from None
    if n < 1 or ms < 0 or n != int(n):
        raise SystemExit("pathcost: --coalesce wants a flush size >= 1 and a window >= 0 ms")
    cfg.coalesce = (int(n), ms / 1e3)
    if f.systems:
        cfg.systems = tuple(s.strip() for s in f.systems.split(",") if s.strip())
        bad = [s for s in cfg.systems if s not in ALL]
        if bad:
            raise SystemExit(f"pathcost: unknown system {bad[0]!r} (one of {', '.join(ALL)})")
    if f.phases:
        cfg.only = tuple(s.strip() for s in f.phases.split(",") if s.strip())
        known = [p.name for p in phases(replace(cfg, only=()))]
        bad = [s for s in cfg.only if s not in known]
        if bad:
            raise SystemExit(f"pathcost: unknown phase {bad[0]!r} (one of {', '.join(known)})")
    if cfg.seconds <= 1.0 or cfg.repeats < 1:
        raise SystemExit("pathcost: --seconds must be > 1 and --repeats >= 1")
    return cfg


def _run(f: Flags) -> Outcome:
    cfg = config_from_args(f)
    res = asyncio.run(run(cfg, f.redis))
    ours = [r[k] for r in res["results"].values() for k in ("tokenrelay", "tokenrelay-sse")
            if k in r]  # fmt: skip
    bad = sum(r["lost"] + r["duplicated"] for r in ours)
    bad += sum(int(x["notes"]["reader_errors"]) for r in ours for x in r["rounds"])
    return Outcome(res, report(res), 1 if bad or res["server_log_tracebacks"] else 0)


BENCH = Harness(
    Flags,
    _run,
    uvloop=True,
    prog="python -m bench.peers.pathcost",
    description=__doc__,
    quick_help="1 round of 3 s per system and phase",
    markdown=report,
)
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
