"""Faults that overlap: a nemesis run under load, checked against Redis at the end.

``python -m bench.faults.nemesis [--quick] [--seed N] [--minutes M] [--json PATH]``

One stack (local Redis Cluster 3 masters + 3 replicas, 2 relays, 2 workers, 2 mock
engines) carries a workload for the whole run: sessions posting turns of the mock
engine's natural lengths back to back, some regenerated, some stopped a moment after
they start; producers of your own in both libraries (a Python process on the producer
API, a Node process on ``@tokenrelay/producer``: :mod:`bench.faults.producers`) writing
sessions of their own; screens over SSE and WebSocket (the Python client, which resumes
from its last offset) on every session, and on every worker session a Durable Streams
reader and an AI SDK UI stream client (:mod:`bench.faults.readers`). A schedule drawn from the seed
(:mod:`bench.faults.schedule`) starts faults in bursts so that they overlap: relays and
workers killed (SIGKILL, restarted after a hold) or frozen (SIGSTOP, SIGCONT after the
hold), masters killed (the replica is promoted, the node comes back as a replica) or
frozen (past the 2 s node timeout: an automatic failover), replicas killed, manual
failovers, slot migrations of live sessions, partitions of a master's client port
(iptables, root only), producer processes killed and started again, and reconnect
storms (half the screens drop at once). The faults are carried out by
:mod:`bench.faults.acts`.

Each fault records its evidence as the single-fault drills do (the killed process's exit
status, who serves a slot before and after, a PING waiting out a freeze or refused by a
partition, a reconnect count); a fault without evidence is an anomaly. A combination
that cannot be survived by design is refused at its time and written in the history:
both nodes of one shard down at once (no setting here waits for replicas: a master
killed before its replica has a frame loses that frame, which the next writer's skip
reports as a ``gap``, never as silence), half of the masters or more killed or frozen at
once (no replica could be elected), and every relay or every worker down at once.

At the end, new turns stop, running ones end, and the checker
(:mod:`bench.load.accounting`) reads every session's backlog from Redis and compares each
screen with it: ``lost``, ``duplicated``, ``out_of_order``, ``content_mismatches``,
``unended_turns``, ``viewers_behind`` (stuck: had not reached its session's end after the
quiet period) must all be 0, and no process the run started may be left. It prints the
history of faults and anomalies and the seed that replays the schedule; exit 1 on any
anomaly.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.faults.acts import Nemesis, line
from bench.faults.evidence import MUST_BE_ZERO
from bench.faults.producers import Producers
from bench.faults.readers import DurableReader, UiReader, check_ui
from bench.faults.run import FaultConfig, Run
from bench.faults.schedule import KINDS, overlapping, plan
from bench.harness import Bench, Common, Outcome, flag
from devstack.demo.stack import Stack, StackSpec

__all__ = ["NemesisConfig", "add_arguments", "main", "run_from_args", "run_nemesis"]


@dataclass
class NemesisConfig:
    minutes: float = 30.0
    bursts: int = 25  # 2-4 faults each: 50-100 faults
    sessions: int = 50
    viewers_per_session: int = 4  # 200 screens
    seed: int = 1
    kinds: list[str] = field(default_factory=lambda: list(KINDS))
    decode_tok_per_s: float = 40.0
    quiet_s: float = 20.0  # after the last fault's start: every screen catches up
    producer_sessions: int = 3  # per library (Python, Node): sessions of their own

    @classmethod
    def quick(cls) -> NemesisConfig:
        return cls(minutes=3.0, bursts=4, sessions=8, viewers_per_session=3, producer_sessions=1)


async def run_nemesis(cfg: NemesisConfig) -> dict[str, Any]:
    duration = cfg.minutes * 60
    faults = plan(seed=cfg.seed, duration_s=duration, bursts=cfg.bursts, kinds=cfg.kinds,
                  quiet_s=cfg.quiet_s)  # fmt: skip
    random.seed(f"{cfg.seed}:nemesis")
    fcfg = FaultConfig(sessions=cfg.sessions, viewers_per_session=cfg.viewers_per_session,
                       decode_tok_per_s=cfg.decode_tok_per_s, seed=cfg.seed,
                       regenerate_share=0.1, stop_share=0.1)  # fmt: skip
    spec = StackSpec(relays=2, workers=2, engines=2, abuse_limits=False,
                     engine_args=["--decode-tok-per-s", str(cfg.decode_tok_per_s)])  # fmt: skip
    pids: list[int] = []
    async with Stack(spec) as stack:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as http:
            run = Run(fcfg, stack, http)
            await run.setup()
            worker_sessions = list(run.sessions)
            until = time.monotonic() + duration - 10
            producers = Producers(
                stack, run, Path(stack.log_dir), sessions=cfg.producer_sessions, seed=cfg.seed,
                until=until,
            )  # fmt: skip
            producers.add_sessions()
            # the two other fronts on every worker session: a Durable Streams reader of its
            # frames (a screen to the checker) and an AI SDK UI stream client
            for sid, tok in worker_sessions:
                reader = DurableReader(http, run.relays, sid, tok)
                reader.on_frame = run._on_frame
                run.viewers.append(reader)
            ui = [UiReader(http, run.relays, sid, tok) for sid, tok in worker_sessions]
            ui_stop = asyncio.Event()
            ui_tasks = [asyncio.create_task(u.run(ui_stop)) for u in ui]
            tasks: dict[int, tuple[asyncio.Task[None], asyncio.Event]] = {}
            for v in run.viewers:
                stop = asyncio.Event()
                tasks[id(v)] = (asyncio.create_task(v.run(stop)), stop)
            await asyncio.sleep(0.5)
            stop_turns = asyncio.Event()
            drivers = [asyncio.create_task(run.drive(sid, tok, stop_turns))
                       for sid, tok in worker_sessions]  # fmt: skip
            producers.start()
            nemesis = Nemesis(run, tasks, producers)
            run.fault_at = nemesis.t0
            print(f"nemesis: seed {cfg.seed}, {len(faults)} faults in {cfg.bursts} bursts, "
                  f"{overlapping(faults)} overlapping, {cfg.minutes:g} min", file=sys.stderr,
                  flush=True)  # fmt: skip
            await nemesis.play(faults)
            await asyncio.sleep(max(0.0, duration - (time.monotonic() - nemesis.t0)))
            stop_turns.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(90):
                    await asyncio.gather(*drivers, return_exceptions=True)
            for d in drivers:
                d.cancel()
            produced = await producers.finish()
            await asyncio.sleep(3.0)  # the last frames reach every screen
            for _task, stop in tasks.values():
                stop.set()
            ui_stop.set()
            await asyncio.gather(*(t for t, _ in tasks.values()), *ui_tasks,
                                 return_exceptions=True)  # fmt: skip
            counts = run.report(await run.account())
            counts.update(check_ui(ui, run.logs))
            counts["durable_readers"] = sum(isinstance(v, DurableReader) for v in run.viewers)
            pids = (
                [m.pid for m in stack.procs.values()]
                + [p.pid for p in (stack.cluster.procs.values() if stack.cluster else [])]
                + [p.pid for p in producers.procs.values()]
            )
    left = [p for p in pids if _alive(p)]
    history = nemesis.history
    done = [e for e in history if "refused" not in e]
    anomalies = [f"{e['kind']} at {e['at_s']}s: " + (e.get("error") or "no evidence it took effect")
                 for e in done if not e.get("took_effect")]  # fmt: skip
    anomalies += [f"{k}: {counts[k]}" for k in (*MUST_BE_ZERO, "ui_mismatches") if counts.get(k)]
    anomalies += [f"processes left over: {left}"] if left else []
    return {
        "seed": cfg.seed,
        "minutes": cfg.minutes,
        "faults_planned": len(faults),
        "faults_carried_out": len(done),
        "faults_refused": len(history) - len(done),
        "overlapping_planned": overlapping(faults),
        "overlapping_carried_out": _overlapping_done(done),
        "history": history,
        "producers": produced,
        **counts,
        "anomalies": anomalies,
        "replay": f"python -m bench.faults.nemesis --seed {cfg.seed} --minutes {cfg.minutes:g} "
        f"--bursts {cfg.bursts}",
    }


def _overlapping_done(done: list[dict[str, Any]]) -> int:
    """How many faults carried out overlapped another in time."""
    spans = [(e["at_s"], max(e.get("ended_s", e["at_s"]), e["at_s"] + 0.1)) for e in done]
    return sum(
        1
        for i, (a0, a1) in enumerate(spans)
        if any(j != i and b0 < a1 and a0 < b1 for j, (b0, b1) in enumerate(spans))
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass
class Flags(Common):
    seed: int = flag(1, "the schedule's seed (the report prints the line that replays it)")
    minutes: float = flag(0.0, "length of the run (0: 30, or 3 with --quick)", least=0)
    bursts: int = flag(0, "bursts of 2-4 overlapping faults (0: 25, or 4 with --quick)", least=0)
    sessions: int = flag(0, "live sessions (0: 50, or 8 with --quick)", least=0)
    kind: list[str] | None = flag(None, "schedule only this kind of fault (repeat for more)",
                                  choices=KINDS)  # fmt: skip


def _run(f: Flags) -> Outcome:
    cfg = NemesisConfig.quick() if f.quick else NemesisConfig()
    cfg.seed = f.seed
    cfg.minutes = f.minutes or cfg.minutes
    cfg.bursts = f.bursts or cfg.bursts
    cfg.sessions = f.sessions or cfg.sessions
    cfg.kinds = list(f.kind or cfg.kinds)
    report = asyncio.run(run_nemesis(cfg))
    lines = [line(e) for e in report["history"]]
    summary = (
        f"nemesis seed {report['seed']}: {report['faults_carried_out']} faults carried out "
        f"({report['overlapping_carried_out']} overlapping), {report['faults_refused']} refused; "
        f"{report['viewers']} screens, {report['sessions']} sessions, {report['turns']} turns, "
        f"{report['frames']} frames (producers' turns: {report['producers']['turns']}); "
        f"lost {report['lost']}, duplicated {report['duplicated']}, "
        f"out of order {report['out_of_order']}, unended {report['unended_turns']}, "
        f"stuck {report['viewers_behind']}, lost writes {report['lost_writes']}, "
        f"gaps reported {report['gaps_reported']}; UI streams: {report['ui_turns_checked']} "
        f"turns checked, {report['ui_mismatches']} mismatches, "
        f"{report['ui_lost_writes']} ended on writes a failover lost"
    )
    text = "\n".join(["history:", *lines, summary, *(f"ANOMALY {a}" for a in report["anomalies"]),
                      f"replay: {report['replay']}"])  # fmt: skip
    return Outcome(report, text, 1 if report["anomalies"] else 0)


def markdown(r: dict[str, Any]) -> str:
    """RELIABILITY.md's tables of a stored run: the counts, then each kind of fault."""
    counts = ("lost", "duplicated", "out_of_order", "content_mismatches", "lost_writes",
              "unended_turns", "viewers_behind", "gaps_reported", "error_frames",
              "ui_turns_checked", "ui_mismatches")  # fmt: skip
    head = ["| seed | minutes | screens | sessions | turns | frames | faults (overlapping) "
            "| refused | " + " | ".join(c.replace("_", " ") for c in counts) + " |",
            "|" + "---|" * (8 + len(counts))]  # fmt: skip
    row = (f"| {r['seed']} | {r['minutes']:g} | {r['viewers']} | {r['sessions']} "
           f"| {r['turns']:,} | {r['frames']:,} | {r['faults_carried_out']} "
           f"({r['overlapping_carried_out']}) | {r['faults_refused']} | "
           + " | ".join(f"{r.get(c, 0):,}" for c in counts) + " |")  # fmt: skip
    kinds: dict[str, list[dict[str, Any]]] = {}
    for e in r["history"]:
        kinds.setdefault(e["kind"], []).append(e)
    table = ["| fault | carried out | took effect | refused (why) |", "|---|---|---|---|"]
    for kind, es in sorted(kinds.items()):
        done = [e for e in es if "refused" not in e]
        why = sorted({e["refused"] for e in es if "refused" in e})
        refused = f"{len(es) - len(done)}" + (f" ({'; '.join(why)})" if why else "")
        took = sum(1 for e in done if e.get("took_effect"))
        table.append(f"| {kind} | {len(done)} | {took} | {refused} |")
    anomalies = r["anomalies"] or ["none"]
    return "\n".join([*head, row, "", *table, "", "Anomalies: " + "; ".join(anomalies)])


BENCH = Bench(Flags, _run, prog="python -m bench.faults.nemesis",
              description=__doc__.split("\n\n")[0], markdown=markdown,
              quick_help="3 minutes, 4 bursts, 8 sessions")  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
