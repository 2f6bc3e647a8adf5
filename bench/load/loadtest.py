"""Load test: many screens watching many sessions while turns stream.

``python -m bench.load.loadtest [--quick] [--seed N] [--duration S] [--viewers K]
[--screens-per-session F] [--turns-per-s R] [--ws-share X] [--json PATH]
[--relay URL ... --worker URL ... --redis URL]``

Without URLs it starts its own stack (local Redis Cluster, 2 relays, 2 workers, 3 mock
engines) and stops it, by pid, at the end. K viewers over SSE and WebSocket (a share X
on WebSocket), F viewers per session, R new turns per second on idle sessions. Replies
have the engine's natural length (the mock engine: mean 300 tokens, a tail to 2,000)
unless ``--max-tokens`` caps them. Every viewer checks every frame and every ``done``
frame's hash; after the drain every viewer is compared with its session's backlog in
Redis (:mod:`bench.load.accounting`): lost, duplicated, out of order, content mismatches and
unended turns must all be 0, or the command exits 1. ``--seed`` fixes the load
generator's choices (sessions, transports, relays); the timing is the machine's.

Reported: TTFT p50/p99 (POST sent -> first token at the viewer), inter-token latency
p50/p99 at the viewer, token frames/s delivered, per-viewer lost/duplicated/out of
order, errors, CPU seconds of relays and workers, RSS, and at the end the leases still
held by workers and the subscriptions still open on relays (both must be 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import re
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from redis.exceptions import RedisClusterException, RedisError

from bench._util import percentile
from bench.harness import Bench, Common, Outcome, flag
from bench.load.accounting import account, read_logs
from bench.load.viewer import Viewer
from devstack.demo.stack import Stack, StackSpec
from relay.broker.errors import RelayError
from relay.broker.rediscluster.connect import check_url, connect, mask_url
from relay.service import runtime

__all__ = ["MUST_BE_ZERO", "LoadConfig", "main", "run_loadtest"]

NAN = float("nan")


@dataclass
class LoadConfig:
    duration_s: float = 60.0
    viewers: int = 500
    screens_per_session: int = 5
    turns_per_s: float = 5.0
    generations: int = 0  # > 0: closed loop, keep this many turns generating at all times
    ws_share: float = 0.5
    connects_per_s: float = 500.0
    max_tokens: int = 0  # 0: not sent, the engine's natural reply length
    relays: list[str] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)
    redis: str = ""  # the cluster of a running stack given by URLs (for the accounting)
    seed: int | None = None
    drain_s: float = 75.0  # running turns get this long to end (2,000 tokens at 40/s: 50 s)
    progress: bool = True
    max_turns: int = 0  # > 0: post at most this many turns (a bound on requests)


def _proc_stats(pid: int) -> tuple[float, int]:
    """(CPU seconds, RSS bytes) of a process from /proc."""
    import os

    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        cpu = (int(fields[11]) + int(fields[12])) / ticks
        rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        return cpu, rss
    except (OSError, IndexError, ValueError):
        return 0.0, 0


_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")


async def _metric_sum(http: aiohttp.ClientSession, url: str, names: tuple[str, ...]) -> float:
    """Sum of the samples of the given metric names on one /metrics page."""
    try:
        async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return float("nan")
    total = 0.0
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m and m.group(1) in names:
            total += float(m.group(3))
    return total


class LoadTest:
    def __init__(self, cfg: LoadConfig, stack: Stack | None) -> None:
        self.cfg = cfg
        self.stack = stack
        self.viewers: list[Viewer] = []
        self.sessions: list[tuple[str, str]] = []
        self.busy: set[str] = set()
        self.posted: dict[tuple[str, int], float] = {}
        self.errors: dict[str, int] = {}
        self.turns_started = 0
        self.rejected = 0
        self.peak_busy = 0
        self.turn_of: dict[str, int] = {}
        self.connected_at_start = 0
        self.ramp_errors = 0
        self._errors_at_start: list[int] = []
        self.loadgen_cpu_s = 0.0

    def relays(self) -> list[str]:
        if self.stack is not None:
            return [p.url for p in self.stack.of_kind("relay") if p.alive]
        return self.cfg.relays

    def workers(self) -> list[str]:
        if self.stack is not None:
            return [p.url for p in self.stack.of_kind("worker") if p.alive]
        return self.cfg.workers

    def _error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    async def create_sessions(self, http: aiohttp.ClientSession, count: int) -> None:
        async def one() -> None:
            base = random.choice(self.workers())
            async with http.post(base + "/v1/sessions") as resp:
                body = await resp.json()
                if resp.status != 201:
                    raise RuntimeError(f"POST /v1/sessions -> {resp.status}: {body}")
                self.sessions.append((body["session"], body["token"]))

        for start in range(0, count, 50):
            await asyncio.gather(*(one() for _ in range(min(50, count - start))))

    def _on_frame(self, viewer: Viewer, frame: dict[str, Any]) -> None:
        # Any screen of the session that sees the turn end frees the session (a screen
        # that has not connected yet must not hold it busy forever).
        if frame["kind"] in ("done", "error") and int(frame.get("turn", 0)) >= self.turn_of.get(
            viewer.sid, 0
        ):
            self.busy.discard(viewer.sid)

    async def post_turn(self, http: aiohttp.ClientSession, sid: str, token: str) -> None:
        base = random.choice(self.workers())
        sent = time.monotonic()
        n = self.turns_started + len(self.posted) + random.randrange(1 << 30)
        body: dict[str, Any] = {"message": f"load test turn {n}"}
        if self.cfg.max_tokens:
            body["max_tokens"] = self.cfg.max_tokens
        headers = {"Authorization": f"Bearer {token}"}
        try:
            async with http.post(
                f"{base}/v1/sessions/{sid}/turns", json=body, headers=headers
            ) as resp:
                data = await resp.json(content_type=None)
                if resp.status == 202:
                    self.posted[(sid, int(data["turn"]))] = sent
                    self.turn_of[sid] = int(data["turn"])
                    self.turns_started += 1
                    return
                if resp.status in (409, 429):
                    self.rejected += 1
                else:
                    self._error(f"POST turn {resp.status}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._error(f"POST turn {type(exc).__name__}")
        self.busy.discard(sid)

    async def run(self) -> dict[str, Any]:
        cfg = self.cfg
        n_sessions = max(1, math.ceil(cfg.viewers / cfg.screens_per_session))
        conn = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(connector=conn) as http:
            await self.create_sessions(http, n_sessions)
            stop = asyncio.Event()
            for i in range(cfg.viewers):
                sid, token = self.sessions[i % n_sessions]
                transport = "ws" if random.random() < cfg.ws_share else "sse"
                v = Viewer(http, self.relays, sid, token, transport=transport)
                v.on_frame = self._on_frame
                self.viewers.append(v)
            # Ramp up like real screens (not one SYN storm), then wait until every viewer
            # is connected before the measured phase starts.
            tasks = []
            for i, v in enumerate(self.viewers):
                tasks.append(asyncio.create_task(v.run(stop)))
                if i % 100 == 99:
                    await asyncio.sleep(100 / cfg.connects_per_s)
            ramp_deadline = time.monotonic() + 60
            while time.monotonic() < ramp_deadline and any(v.connects == 0 for v in self.viewers):
                await asyncio.sleep(0.2)
            self.connected_at_start = sum(1 for v in self.viewers if v.connects > 0)
            self.ramp_errors = sum(len(v.errors) for v in self.viewers)
            self._errors_at_start = [len(v.errors) for v in self.viewers]
            procs = self.stack.procs.values() if self.stack else []
            cpu0 = {p.name: _proc_stats(p.pid) for p in procs}
            gen0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.monotonic()
            token_frames0 = sum(len(t) for v in self.viewers for t in v.turn_text.values())
            tokens0 = sum(v.tokens for v in self.viewers)
            await self._drive(http, t0)
            ran_s = time.monotonic() - t0
            # delivered during the measured phase only (not the drain after it)
            token_frames = sum(len(t) for v in self.viewers for t in v.turn_text.values())
            tokens = sum(v.tokens for v in self.viewers) - tokens0
            drain_deadline = time.monotonic() + cfg.drain_s
            while self.busy and time.monotonic() < drain_deadline:
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)  # the last frames reach every screen
            cpu1 = {p.name: _proc_stats(p.pid) for p in procs}
            gen1 = resource.getrusage(resource.RUSAGE_SELF)
            self.loadgen_cpu_s = (gen1.ru_utime + gen1.ru_stime) - (gen0.ru_utime + gen0.ru_stime)
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            counts = await self._account()
            await asyncio.sleep(3.0)  # relays unsubscribe after their delay
            leases = sum(
                [
                    await _metric_sum(http, w, ("tokenrelay_worker_engine_in_flight",))
                    for w in self.workers()
                ]
            )
            subs = sum(
                [
                    await _metric_sum(http, r, ("tokenrelay_relay_subscriptions",))
                    for r in self.relays()
                ]
            )
        return self._report(
            ran_s, tokens, token_frames - token_frames0, counts, cpu0, cpu1, leases, subs
        )

    async def _account(self) -> dict[str, Any]:
        """Every viewer against its session's backlog in Redis (bench.load.accounting)."""
        url = self.stack.redis_url if self.stack is not None else self.cfg.redis
        redis = connect(url)
        try:
            await redis.initialize()
            logs = await read_logs(redis, [sid for sid, _ in self.sessions])
        finally:
            await redis.aclose()
        return account(logs, self.viewers, self.posted)

    async def _drive(self, http: aiohttp.ClientSession, t0: float) -> None:
        cfg = self.cfg
        interval = 1.0 / cfg.turns_per_s if cfg.turns_per_s > 0 else math.inf
        bar = None
        if cfg.progress:
            with contextlib.suppress(ImportError):
                from tqdm import tqdm

                bar = tqdm(total=int(cfg.duration_s), unit="s", desc="load", file=sys.stderr)
        pending: set[asyncio.Task[None]] = set()
        next_at = t0
        shown = 0
        while (now := time.monotonic()) < t0 + cfg.duration_s:
            if cfg.max_turns and self.turns_started + len(pending) >= cfg.max_turns:
                await asyncio.sleep(0.05)  # the request budget is spent: load ends here
                continue
            while cfg.generations and len(self.busy) < cfg.generations:
                idle = [s for s in self.sessions if s[0] not in self.busy]
                if not idle:
                    break
                sid, token = random.choice(idle)
                self.busy.add(sid)
                task = asyncio.create_task(self.post_turn(http, sid, token))
                pending.add(task)
                task.add_done_callback(pending.discard)
            self.peak_busy = max(self.peak_busy, len(self.busy))
            if not cfg.generations and now >= next_at:
                next_at += interval
                idle = [s for s in self.sessions if s[0] not in self.busy]
                if idle:
                    sid, token = random.choice(idle)
                    self.busy.add(sid)
                    task = asyncio.create_task(self.post_turn(http, sid, token))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
            if bar is not None and int(now - t0) > shown:
                bar.update(int(now - t0) - shown)
                shown = int(now - t0)
                bar.set_postfix(
                    turns=self.turns_started, busy=len(self.busy), rejected=self.rejected
                )
            await asyncio.sleep(min(0.05, max(0.0, next_at - time.monotonic())))
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        if bar is not None:
            bar.close()

    def _report(
        self,
        ran_s: float,
        tokens: int,
        token_frames: int,
        counts: dict[str, Any],
        cpu0: dict[str, tuple[float, int]],
        cpu1: dict[str, tuple[float, int]],
        leases: float,
        subs: float,
    ) -> dict[str, Any]:
        ttft: list[float] = []
        itl: list[float] = []
        for v in self.viewers:
            itl.extend(v.itl_ms)
            for turn, first in v.turn_first_token.items():
                sent = self.posted.get((v.sid, turn))
                if sent is not None:
                    ttft.append((first - sent) * 1000)
        for v, skip in zip(self.viewers, self._errors_at_start, strict=False):
            for e in v.errors[skip:]:
                self._error("viewer " + e.split(":")[0])
        errors = sum(self.errors.values()) + sum(v.error_frames for v in self.viewers)

        # None when the stack is not ours (--relay/--worker URLs): its processes are not
        # visible from here, and 0.0 would read as "measured, and idle"
        def cpu(kind: str) -> float | None:
            if not cpu0:
                return None
            return round(sum(cpu1[n][0] - cpu0[n][0] for n in cpu0 if n.startswith(kind + "-")), 2)

        def rss_mb(kind: str, at: dict[str, tuple[float, int]]) -> float | None:
            if not at:
                return None
            return round(sum(at[n][1] for n in at if n.startswith(kind + "-")) / 2**20, 1)

        def drift(kind: str) -> float | None:
            end, start = rss_mb(kind, cpu1), rss_mb(kind, cpu0)
            return None if end is None or start is None else round(end - start, 1)

        return {
            "viewers": len(self.viewers),
            "sessions": len(self.sessions),
            "duration_s": round(ran_s, 1),
            "turns": self.turns_started,
            "turns_rejected": self.rejected,
            "peak_generations": self.peak_busy,
            "ttft_p50_ms": round(percentile(ttft, 0.50, NAN), 1),
            "ttft_p99_ms": round(percentile(ttft, 0.99, NAN), 1),
            "itl_p50_ms": round(percentile(itl, 0.50, NAN), 1),
            "itl_p99_ms": round(percentile(itl, 0.99, NAN), 1),
            "tokens_per_s": round(tokens / ran_s, 1) if ran_s else 0.0,
            "token_frames_per_s": round(token_frames / ran_s, 1) if ran_s else 0.0,
            **counts,
            "gaps_reported": sum(v.tally.gaps_reported for v in self.viewers),
            "errors": errors,
            "error_detail": self.errors,
            "error_samples": sorted({e[:160] for v in self.viewers for e in v.errors})[:8],
            "error_frames": sum(v.error_frames for v in self.viewers),
            "reconnects": sum(max(0, v.connects - 1) for v in self.viewers),
            "seed": self.cfg.seed,
            "relay_cpu_s": cpu("relay"),
            "worker_cpu_s": cpu("worker"),
            "engine_cpu_s": cpu("engine"),
            "relay_rss_mb": rss_mb("relay", cpu1),
            "worker_rss_mb": rss_mb("worker", cpu1),
            "relay_rss_drift_mb": drift("relay"),
            "worker_rss_drift_mb": drift("worker"),
            "loadgen_cpu_s": round(self.loadgen_cpu_s, 2),
            "connected_at_start": self.connected_at_start,
            "ramp_errors": self.ramp_errors,
            "leases_held_end": leases,
            "subscriptions_end": subs,
        }


async def run_loadtest(cfg: LoadConfig, spec: StackSpec | None = None) -> dict[str, Any]:
    if cfg.seed is not None:
        random.seed(cfg.seed)
    if cfg.relays and cfg.workers and cfg.redis:
        return await LoadTest(cfg, None).run()
    spec = spec or StackSpec(relays=2, workers=2, engines=3, abuse_limits=False)
    async with Stack(spec) as stack:
        return await LoadTest(cfg, stack).run()


def _print(report: dict[str, Any]) -> None:
    keys = [
        "viewers",
        "sessions",
        "duration_s",
        "turns",
        "turns_rejected",
        "peak_generations",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "itl_p50_ms",
        "itl_p99_ms",
        "tokens_per_s",
        "token_frames_per_s",
        "reply_tokens_mean",
        "reply_tokens_max",
        "lost",
        "duplicated",
        "out_of_order",
        "content_mismatches",
        "unended_turns",
        "turns_checked",
        "done_frames_checked",
        "gaps_reported",
        "errors",
        "reconnects",
        "viewers_behind",
        "relay_cpu_s",
        "worker_cpu_s",
        "relay_rss_mb",
        "worker_rss_mb",
        "relay_rss_drift_mb",
        "worker_rss_drift_mb",
        "loadgen_cpu_s",
        "connected_at_start",
        "ramp_errors",
        "leases_held_end",
        "subscriptions_end",
    ]
    width = max(map(len, keys))
    for k in keys:
        print(f"{k:<{width}}  {report[k]}")
    if report["error_detail"]:
        print(f"{'error_detail':<{width}}  {report['error_detail']}")


# the promise (nothing lost, duplicated, reordered or altered, every turn ended, no
# error) and a clean end state: any of these non-zero makes the command exit 1
MUST_BE_ZERO = (
    "lost",
    "duplicated",
    "out_of_order",
    "content_mismatches",
    "unended_turns",
    "errors",
    "leases_held_end",
    "subscriptions_end",
)


@dataclass
class Flags(Common):
    duration: float = flag(60.0, "seconds of load", quick=20.0, above=0)
    viewers: int = flag(500, "concurrent viewers", quick=60, least=1)
    screens_per_session: int = flag(5, "screens per session", least=1)
    turns_per_s: float = flag(5.0, "new turns per second (0: no open-loop turns)", quick=3.0,
                              least=0)  # fmt: skip
    generations: int = flag(0, "closed loop: keep N turns generating at all times (instead of "
                            "--turns-per-s)", least=0)  # fmt: skip
    ws_share: float = flag(0.5, "share of viewers on WebSocket", least=0)
    max_turns: int = flag(0, "post at most N turns (0: no bound)", least=0)
    connects_per_s: float = flag(500.0, "ramp-up rate of new viewers", above=0)
    max_tokens: int = flag(0, "cap every reply (0: not sent; the engine's natural length)",
                           least=0)  # fmt: skip
    seed: int | None = flag(None, "seed the load generator's choices")  # type: ignore[assignment]
    redis: str = flag("", "the Redis Cluster of a running stack (URLs)")
    relay: list[str] = flag([], "relay URL of a running stack")
    worker: list[str] = flag([], "worker URL of a running stack")
    engine_cap: int = flag(16, "in-flight cap per engine", least=1)
    engine_concurrency: int = flag(32, "mock engines' --max-concurrency", least=1)
    no_progress: bool = flag(False, "no progress lines")


def config_from_args(f: Flags) -> LoadConfig:
    return LoadConfig(
        duration_s=f.duration,
        viewers=f.viewers,
        screens_per_session=f.screens_per_session,
        turns_per_s=f.turns_per_s,
        max_turns=f.max_turns,
        generations=f.generations,
        connects_per_s=f.connects_per_s,
        ws_share=f.ws_share,
        max_tokens=f.max_tokens,
        relays=f.relay,
        workers=f.worker,
        redis=f.redis,
        seed=f.seed,
        progress=not f.no_progress,
    )


def _run(f: Flags) -> Outcome | int:
    if bool(f.relay) != bool(f.worker) or bool(f.relay) != bool(f.redis):
        print("error: give --relay, --worker and --redis URLs, or none", file=sys.stderr)
        return 2
    try:
        if f.redis:
            check_url(f.redis)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    spec = StackSpec(
        relays=2,
        workers=2,
        engines=3,
        abuse_limits=False,  # every simulated client is 127.0.0.1
        engine_cap=f.engine_cap,
        engine_args=["--max-concurrency", str(f.engine_concurrency)],
    )
    try:
        report = runtime.run(run_loadtest(config_from_args(f), spec))
    except (aiohttp.ClientError, OSError, RedisError, RedisClusterException, RelayError) as exc:
        # a running stack given by URLs that does not answer: one line, never a traceback
        where = ", ".join([*f.relay, *f.worker, mask_url(f.redis)]) or "its own stack"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        print(f"error: the load test cannot reach {where}: {first}", file=sys.stderr)
        return 1
    _print(report)
    # the promise (nothing lost, duplicated or reordered, no error) and a clean end state
    bad = [k for k in MUST_BE_ZERO if report[k]]
    if bad:
        print(f"FAILED: non-zero {', '.join(bad)}", file=sys.stderr)
    return Outcome(report, code=1 if bad else 0)


BENCH = Bench(Flags, _run, prog="python -m bench.load.loadtest", quick_help="20 s, 60 viewers, "
              "3 turns/s", description=__doc__.split("\n\n")[0])  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
