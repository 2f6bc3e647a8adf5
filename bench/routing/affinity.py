"""Cache affinity end to end: what the mock engines' prefix caches report under the
worker's ring routing beside a cache-blind round robin.

What it answers: does routing on the conversation prefix (``worker.routing.router``, bounded
loads) make the engines' KV caches hit, with real worker turns, real engines' caches and a
real Redis Cluster, not in the simulator? For each routing policy it starts fresh mock
engines (empty caches) and two workers as processes (``devstack.demo.stack``; the workers share
the caps through the load exchange), sends ``--sessions`` concurrent multi-turn
conversations to the workers in turn, without stickiness (each turn waits for the
previous one's ``done`` in the session's backlog); then it reads
every engine's ``/metrics`` (``vllm:prefix_cache_hits_total`` over
``vllm:prefix_cache_queries_total``, tokens) and the TTFT of every turn from its ``done``
frame.

Workload: ``--system-prompts`` shared system prompts (about 300 tokens each; many
sessions share one, as in a product with a few assistants), a user message of about
40 tokens per turn, replies of up to 32 tokens. Under the ring a session's turns return
to the engine holding its history; under round robin each turn goes to the next engine,
which holds the shared system prompt but rarely that session's history.

Call order: ``await run(cfg, redis)`` with a connected ``RedisCluster`` (tests use the
suite's cluster) -> dict; ``main()`` is the CLI and starts a local cluster itself
(``--redis URL`` uses a running one): ``python -m bench.routing.affinity [--quick] [--json PATH]``.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
from redis.asyncio import RedisCluster

from bench._util import percentile
from bench.harness import Bench, OnCluster, Outcome, bench_stack, flag
from devstack.demo.stack import Stack, StackSpec
from relay.broker.rediscluster.connect import connect
from relay.broker.rediscluster.publisher import read_backlog
from relay.protocol.frame import decode
from worker.routing.policy import ROUTING_POLICIES

__all__ = ["AffinityConfig", "add_arguments", "main", "run", "run_from_args"]

_WORDS = (  # noqa: SIM905 (readable as prose)
    "how does the cache keep a prefix warm when many sessions share one system prompt "
    "and why would a router send the next turn back to the same engine that holds it "
    "tell me about shards relays workers queues latency tokens streams and screens"
).split()


@dataclass(frozen=True)
class AffinityConfig:
    sessions: int = 200
    turns: int = 4
    engines: int = 3
    workers: int = 2
    system_prompts: int = 8
    kv_tokens: int = 65_536  # per engine (the mock's default)
    engine_cap: int = 80  # in-flight per engine: 200 sessions fit at once
    max_tokens: int = 32
    decode_tok_per_s: float = 400.0
    prefill_tok_per_s: float = 4_000.0  # the mock's default: a miss costs ~0.1 s here
    turn_timeout_s: float = 60.0
    seed: int = 7


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _scrape(text: str, name: str) -> float:
    """Sum of one metric's samples in a Prometheus text exposition."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


class _Run:
    """One policy: a stack of processes (mock engines, workers; no relay needed), the
    sessions driven from this process, the figures."""

    def __init__(self, cfg: AffinityConfig, redis: RedisCluster, url: str, policy: str) -> None:
        self.cfg, self.redis, self.policy = cfg, redis, policy
        self.spec = StackSpec(
            relays=0,
            workers=cfg.workers,
            engines=cfg.engines,
            redis_url=url,
            insecure_no_auth=True,
            abuse_limits=False,  # sessions and turns driven as fast as the engines take them
            engine_cap=cfg.engine_cap,
            engine_args=[
                "--kv-tokens", str(cfg.kv_tokens),
                "--prefill-tok-per-s", str(cfg.prefill_tok_per_s),
                "--decode-tok-per-s", str(cfg.decode_tok_per_s),
                "--max-concurrency", str(cfg.engine_cap),
            ],
            worker_args=[
                "--routing", policy,
                "--presence-grace-s", str(cfg.turn_timeout_s),  # nobody watches here
            ],
        )  # fmt: skip
        self.stack: Stack | None = None
        self.ttft_ms: list[float] = []
        self.turns_done = 0
        self.errors: list[str] = []
        self.rejected = 0  # 409/429 answers that were retried
        self._next = 0

    async def start(self) -> None:
        self.stack = Stack(self.spec)
        await self.stack.__aenter__()

    async def stop(self) -> None:
        if self.stack is not None:
            await self.stack.stop()

    def _worker(self) -> str:
        """Turns go to the workers in turn (no stickiness), as a front door sends them."""
        assert self.stack is not None
        urls = self.stack.worker_urls
        self._next += 1
        return urls[self._next % len(urls)]

    async def session(self, http: aiohttp.ClientSession, rng: random.Random, system: str) -> None:
        async with http.post(f"{self._worker()}/v1/sessions") as r:
            if r.status != 201:
                self.errors.append(f"POST session {r.status}")
                return
            sid = (await r.json())["session"]
        for _ in range(self.cfg.turns):
            body = {
                "message": _text(rng, 40),
                "system": system,
                "max_tokens": self.cfg.max_tokens,
            }
            turn, offset = await self._post_turn(http, sid, body)
            if turn < 0:
                return
            if not await self._wait_done(sid, turn, offset):
                return

    async def _post_turn(
        self, http: aiohttp.ClientSession, sid: str, body: dict[str, Any]
    ) -> tuple[int, int]:
        deadline = time.monotonic() + self.cfg.turn_timeout_s
        while time.monotonic() < deadline:
            url = f"{self._worker()}/v1/sessions/{sid}/turns"
            async with http.post(url, json=body) as r:
                data = await r.json(content_type=None)
                if r.status == 202:
                    return int(data["turn"]), int(data["offset"])
                if r.status not in (409, 429):
                    self.errors.append(f"POST turn {r.status}: {data}")
                    return -1, 0
                self.rejected += 1
                await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
        self.errors.append("POST turn: still refused at the deadline")
        return -1, 0

    async def _wait_done(self, sid: str, turn: int, offset: int) -> bool:
        deadline = time.monotonic() + self.cfg.turn_timeout_s
        after = offset - 1
        while time.monotonic() < deadline:
            raw, _, _ = await read_backlog(self.redis, sid, after, 1000)
            for blob in raw:
                frame = decode(blob)
                after = max(after, frame.offset)
                if frame.turn != turn or frame.kind not in ("done", "error"):
                    continue
                if frame.kind == "error":
                    self.errors.append(f"turn error: {frame.meta}")
                    return False
                ttft = (frame.meta or {}).get("ttft_ms")
                if isinstance(ttft, int | float):
                    self.ttft_ms.append(float(ttft))
                self.turns_done += 1
                return True
            await asyncio.sleep(0.1)
        self.errors.append(f"turn {turn} of {sid} did not end in {self.cfg.turn_timeout_s}s")
        return False

    async def figures(self, http: aiohttp.ClientSession, wall_s: float) -> dict[str, Any]:
        assert self.stack is not None
        per_engine: dict[str, float] = {}
        hits = queries = 0.0
        for e in self.stack.of_kind("engine"):
            async with http.get(e.url + "/metrics") as r:
                text = await r.text()
            h = _scrape(text, "vllm:prefix_cache_hits_total")
            q = _scrape(text, "vllm:prefix_cache_queries_total")
            per_engine[e.name] = round(h / q, 4) if q else 0.0
            hits, queries = hits + h, queries + q
        p50, p99 = percentile(self.ttft_ms, 0.5), percentile(self.ttft_ms, 0.99)
        return {
            "hit_rate": round(hits / queries, 4) if queries else 0.0,
            "hit_rate_per_engine": per_engine,
            "prompt_tokens": int(queries),
            "cached_tokens": int(hits),
            "turns_done": self.turns_done,
            "errors": len(self.errors),
            "error_samples": self.errors[:5],
            "retried_posts": self.rejected,
            "ttft_p50_ms": p50,
            "ttft_p99_ms": p99,
            "wall_s": round(wall_s, 2),
        }


async def run_policy(
    cfg: AffinityConfig, redis: RedisCluster, url: str, policy: str
) -> dict[str, Any]:
    rng = random.Random(cfg.seed)  # the same conversations for every policy
    systems = [f"You are assistant {i}. " + _text(rng, 300) for i in range(cfg.system_prompts)]
    run = _Run(cfg, redis, url, policy)
    await run.start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            t0 = time.monotonic()
            await asyncio.gather(
                *(
                    run.session(http, random.Random(cfg.seed * 1000 + i), rng.choice(systems))
                    for i in range(cfg.sessions)
                )
            )
            return await run.figures(http, time.monotonic() - t0)
    finally:
        await run.stop()


async def run(cfg: AffinityConfig, redis: RedisCluster, url: str) -> dict[str, Any]:
    """Both policies on the cluster at ``url`` (``redis``: a client connected to it)."""
    out: dict[str, Any] = {"config": asdict(cfg), "policies": {}}
    # precise needs engines that publish KV events (the mock engine with --kv-events-port)
    # and their tokenizer: bench.routing.precise measures it; this bench runs the rest.
    for policy in (p for p in ROUTING_POLICIES if p != "precise"):
        out["policies"][policy] = await run_policy(cfg, redis, url, policy)
    ring, rr = out["policies"]["ring"], out["policies"]["round_robin"]
    out["hit_rate_gain"] = round(ring["hit_rate"] - rr["hit_rate"], 4)
    return out


def _table(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = [
        f"{c['sessions']} concurrent sessions x {c['turns']} turns, {c['engines']} mock "
        f"engines ({c['kv_tokens']} KV tokens each), {c['system_prompts']} shared prompts",
        f"{'routing':<13}{'hit rate':>10}{'per engine':>28}{'TTFT p50':>10}{'p99':>9}"
        f"{'turns':>7}{'errors':>8}{'wall':>8}",
    ]
    for name, r in res["policies"].items():
        per = " ".join(f"{v:.2f}" for v in r["hit_rate_per_engine"].values())
        lines.append(
            f"{name:<13}{r['hit_rate']:>10.3f}{per:>28}{r['ttft_p50_ms'] or 0:>9.1f}ms"
            f"{r['ttft_p99_ms'] or 0:>7.1f}ms{r['turns_done']:>7}{r['errors']:>8}"
            f"{r['wall_s']:>7.1f}s"
        )
    lines.append(f"hit-rate gain of the ring over round robin: {res['hit_rate_gain']:+.3f}")
    return "\n".join(lines)


_D = AffinityConfig()


@dataclass
class Flags(OnCluster):
    sessions: int = flag(_D.sessions, "concurrent sessions", quick=60, least=1)
    turns: int = flag(_D.turns, "turns per session", quick=3, least=1)
    engines: int = flag(_D.engines, "mock engines", least=1)
    kv_tokens: int = flag(_D.kv_tokens, "KV tokens per engine", least=1)
    seed: int = flag(_D.seed, "the sessions' prompts")


async def _main(f: Flags) -> dict[str, Any]:
    cfg = AffinityConfig(sessions=f.sessions, turns=f.turns, engines=f.engines,
                         kv_tokens=f.kv_tokens, seed=f.seed)  # fmt: skip
    async with bench_stack("affinity-") as st:
        url = await st.cluster(masters=3, replicas=1, url=f.redis)
        redis = connect(url)
        st.on_exit(redis.aclose)
        await redis.initialize()
        return await run(cfg, redis, url)


def _run(f: Flags) -> Outcome:
    res = asyncio.run(_main(f))
    bad = sum(r["errors"] for r in res["policies"].values())
    return Outcome(res, _table(res), 1 if bad else 0)


BENCH = Bench(Flags, _run, prog="python -m bench.routing.affinity", description=__doc__,
              quick_help="60 sessions x 3 turns")  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
