"""Routing on real engines: llama.cpp's ``llama-server`` (SmolLM2-135M on the CPU) under
the worker's routing policies, prefill counted by the engines themselves.

What it answers: on engines with a real prefix cache (llama.cpp's slots, each holding one
conversation's tokens), how much prompt do the engines compute, how much of each prompt
do they reuse, and how long do screens wait for the first token, under ``cost_aware``,
``ring`` (sticky: a session's key always to the same engine) and ``round_robin``, at 1
and 2 slots per engine? For each slot count and policy it starts fresh servers (empty
caches; ``devstack.llama.serve``) and two workers as processes (``devstack.demo.stack``,
the load exchange on), then drives ``--sessions`` conversations of ``--turns`` turns,
``--live`` of them at once, each turn posted to the workers in turn (no stickiness) and
waited for in the session's backlog. Figures:

- **computed prompt tokens**: the sum of the engines' ``llamacpp:prompt_tokens_total``
  (tokens they prefilled; a reused prefix is not counted), and its ratio to round robin;
- **reused %**: the share of the turns' prompt tokens the engines reported as cached
  (``done`` meta, from their ``timings``);
- **evicted follow-ups**: turns after a session's first whose engine reused less than
  the previous turn's prompt (its slot had been given to another conversation, or the
  turn went to another engine);
- **TTFT** p50/p90 of the screens (the ``done`` meta's ``ttft_ms``), errors;
- the engines' own prefill and decode rates (``llamacpp:prompt_tokens_seconds``,
  ``llamacpp:predicted_tokens_seconds``).

Needs the built engine (``python -m devstack llama build``); without it, one line saying
why and exit 2. ``python -m bench.routing.realengine [--quick] [--json PATH] [--seed N]``.
"""

from __future__ import annotations

import asyncio
import random
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
from redis.asyncio import RedisCluster

from bench._util import percentile
from bench.harness import Bench, OnCluster, Outcome, bench_stack, flag
from devstack.demo.stack import Stack, StackSpec
from devstack.llama.build import Built, find, missing_toolchain
from devstack.llama.serve import MODEL, llama_servers
from relay.broker.rediscluster.connect import connect
from relay.broker.rediscluster.publisher import read_backlog
from relay.protocol.frame import decode

__all__ = ["RealEngineConfig", "add_arguments", "main", "run", "run_from_args"]

_WORDS = (  # noqa: SIM905 (readable as prose)
    "tell me about the sea the wind and the tides why ships keep to their routes how a "
    "harbour works what sailors eat and where the fish go in winter and summer nights"
).split()
POLICIES = ("cost_aware", "ring", "round_robin")
# a follow-up whose engine reused less than the previous prompt by more than this found
# its prefix evicted (a block cache, as the mock's, reuses whole 16-token blocks)
_BLOCK = 16


@dataclass(frozen=True)
class RealEngineConfig:
    sessions: int = 20
    turns: int = 5
    live: int = 4  # sessions at once
    engines: int = 2
    slots: tuple[int, ...] = (1, 2)
    policies: tuple[str, ...] = POLICIES
    ctx_per_slot: int = 2048
    threads: int = 1
    max_tokens: int = 24
    system_prompts: int = 2
    turn_timeout_s: float = 300.0
    seed: int = 7


@dataclass
class _Figures:
    ttft_ms: list[float] = field(default_factory=list)
    prompt: int = 0
    cached: int = 0
    follow_ups: int = 0
    evicted: int = 0
    turns: int = 0
    errors: list[str] = field(default_factory=list)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _scrape(text: str, name: str) -> float:
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


class _Run:
    def __init__(self, cfg: RealEngineConfig, redis: RedisCluster, stack: Stack) -> None:
        self.cfg, self.redis, self.stack = cfg, redis, stack
        self.fig = _Figures()
        self._next = 0

    def _worker(self) -> str:
        urls = self.stack.worker_urls
        self._next += 1
        return urls[self._next % len(urls)]

    async def session(self, http: aiohttp.ClientSession, rng: random.Random, system: str) -> None:
        async with http.post(f"{self._worker()}/v1/sessions") as r:
            if r.status != 201:
                self.fig.errors.append(f"POST session {r.status}")
                return
            sid = (await r.json())["session"]
        prev_prompt = 0
        for i in range(self.cfg.turns):
            body = {"message": _text(rng, 30), "system": system,
                    "max_tokens": self.cfg.max_tokens}  # fmt: skip
            meta = await self._turn(http, sid, body)
            if meta is None:
                return
            self.fig.turns += 1
            ttft, prompt, cached = (
                meta.get("ttft_ms"),
                meta.get("prompt_tokens"),
                meta.get("cached_tokens"),
            )
            if isinstance(ttft, int | float):
                self.fig.ttft_ms.append(float(ttft))
            if isinstance(prompt, int) and isinstance(cached, int):
                self.fig.prompt += prompt
                self.fig.cached += cached
                if i > 0:
                    self.fig.follow_ups += 1
                    if cached < prev_prompt - _BLOCK:
                        self.fig.evicted += 1
                prev_prompt = prompt

    async def _turn(
        self, http: aiohttp.ClientSession, sid: str, body: dict[str, Any]
    ) -> dict[str, Any] | None:
        deadline = time.monotonic() + self.cfg.turn_timeout_s
        while True:
            async with http.post(f"{self._worker()}/v1/sessions/{sid}/turns", json=body) as r:
                data = await r.json(content_type=None)
                if r.status == 202:
                    break
                if r.status not in (409, 429) or time.monotonic() > deadline:
                    self.fig.errors.append(f"POST turn {r.status}: {data}")
                    return None
                await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
        turn, after = int(data["turn"]), int(data["offset"]) - 1
        while time.monotonic() < deadline:
            raw, _, _ = await read_backlog(self.redis, sid, after, 1000)
            for blob in raw:
                frame = decode(blob)
                after = max(after, frame.offset)
                if frame.turn == turn and frame.kind == "done":
                    return frame.meta or {}
                if frame.turn == turn and frame.kind == "error":
                    self.fig.errors.append(f"turn error: {frame.text}")
                    return None
            await asyncio.sleep(0.1)
        self.fig.errors.append(f"turn {turn} of {sid} did not end in time")
        return None


async def run_one(
    cfg: RealEngineConfig, built: Built, redis: RedisCluster, url: str, slots: int, policy: str
) -> dict[str, Any]:
    rng = random.Random(cfg.seed)  # the same conversations under every policy
    systems = [f"You are assistant {i}. " + _text(rng, 80) for i in range(cfg.system_prompts)]
    with tempfile.TemporaryDirectory(prefix="realengine-") as logs:
        ctx = slots * cfg.ctx_per_slot
        engines = llama_servers(built, cfg.engines, logs, slots=slots, ctx=ctx, threads=cfg.threads)
        async with engines as servers:
            spec = StackSpec(
                relays=0, workers=2, redis_url=url, insecure_no_auth=True, abuse_limits=False,
                engine_urls=[f"{s.id}={s.url}" for s in servers], model=MODEL,
                engine_cap=slots, log_dir=logs,
                worker_args=["--routing", policy, "--presence-grace-s", "600",
                             "--first-token-timeout-s", str(cfg.turn_timeout_s),
                             "--idle-timeout-s", "120", "--admit-wait-s", "4"],
            )  # fmt: skip
            async with Stack(spec) as stack, aiohttp.ClientSession() as http:
                await asyncio.sleep(1.0)  # the workers' first /props read (slots, context)
                run = _Run(cfg, redis, stack)
                gate = asyncio.Semaphore(cfg.live)

                async def one(i: int) -> None:
                    async with gate:
                        await run.session(http, random.Random(cfg.seed * 1000 + i),
                                          systems[i % len(systems)])  # fmt: skip

                t0 = time.monotonic()
                await asyncio.gather(*(one(i) for i in range(cfg.sessions)))
                wall = time.monotonic() - t0
                computed = prefill_rate = decode_rate = 0.0
                for s in servers:
                    async with http.get(s.url + "/metrics") as r:
                        text = await r.text()
                    computed += _scrape(text, "llamacpp:prompt_tokens_total")
                    prefill_rate += _scrape(text, "llamacpp:prompt_tokens_seconds") / len(servers)
                    decode_rate += _scrape(text, "llamacpp:predicted_tokens_seconds") / len(servers)
    f = run.fig
    return {
        "computed_prompt_tokens": int(computed),
        "prompt_tokens": f.prompt,
        "reused_pct": round(100 * f.cached / f.prompt, 1) if f.prompt else 0.0,
        "follow_ups": f.follow_ups,
        "evicted_follow_ups": f.evicted,
        "ttft_p50_ms": percentile(f.ttft_ms, 0.5),
        "ttft_p90_ms": percentile(f.ttft_ms, 0.9),
        "turns": f.turns,
        "errors": len(f.errors),
        "error_samples": f.errors[:5],
        "engine_prefill_tok_s": round(prefill_rate, 1),
        "engine_decode_tok_s": round(decode_rate, 1),
        "wall_s": round(wall, 1),
    }


async def run(cfg: RealEngineConfig, built: Built, redis: RedisCluster, url: str) -> dict[str, Any]:
    out: dict[str, Any] = {"config": asdict(cfg), "slots": {}}
    for slots in cfg.slots:
        per: dict[str, Any] = {}
        for policy in cfg.policies:
            per[policy] = await run_one(cfg, built, redis, url, slots, policy)
        rr = per.get("round_robin", {}).get("computed_prompt_tokens")
        for r in per.values():
            r["vs_round_robin"] = round(r["computed_prompt_tokens"] / rr, 2) if rr else None
        out["slots"][str(slots)] = per
    return out


def table(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = [
        f"{c['sessions']} sessions x {c['turns']} turns, {c['live']} live at a time, "
        f"{c['engines']} llama-server engines (SmolLM2-135M Q4_1, {c['threads']} CPU thread "
        f"each), max_tokens {c['max_tokens']}, seed {c['seed']}",
        "",
        "| slots | routing | computed prompt tokens | vs round robin | reused | evicted "
        "follow-ups | TTFT p50 | TTFT p90 | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for slots, per in res["slots"].items():
        for name, r in per.items():
            lines.append(
                f"| {slots} | {name} | {r['computed_prompt_tokens']:,} | "
                f"{r['vs_round_robin']}x | {r['reused_pct']} % | "
                f"{r['evicted_follow_ups']} of {r['follow_ups']} | "
                f"{(r['ttft_p50_ms'] or 0) / 1000:.2f} s | {(r['ttft_p90_ms'] or 0) / 1000:.2f} s "
                f"| {r['errors']} |"
            )
    rates = [(r["engine_prefill_tok_s"], r["engine_decode_tok_s"])
             for per in res["slots"].values() for r in per.values()]  # fmt: skip
    if rates:
        pre = sum(p for p, _ in rates) / len(rates)
        dec = sum(d for _, d in rates) / len(rates)
        lines += ["", f"the engines' own rates (mean over the runs): prefill {pre:.0f} tokens/s, "
                      f"decode {dec:.0f} tokens/s"]  # fmt: skip
    return "\n".join(lines)


_D = RealEngineConfig()


@dataclass
class Flags(OnCluster):
    sessions: int = flag(_D.sessions, "conversations", quick=6, least=1)
    turns: int = flag(_D.turns, "turns per conversation", quick=3, least=1)
    live: int = flag(_D.live, "conversations at once", quick=2, least=1)
    slots: str = flag("1,2", "slots per engine, comma-separated (llama-server -np)", quick="2")
    policies: str = flag(",".join(POLICIES), "routing policies, comma-separated",
                         quick="cost_aware,round_robin")  # fmt: skip
    threads: int = flag(_D.threads, "CPU threads per engine", least=1)
    seed: int = flag(_D.seed, "the conversations' prompts")


async def _main(f: Flags, built: Built) -> dict[str, Any]:
    cfg = RealEngineConfig(
        sessions=f.sessions, turns=f.turns, live=f.live, threads=f.threads, seed=f.seed,
        slots=tuple(int(s) for s in f.slots.split(",") if s),
        policies=tuple(p for p in f.policies.split(",") if p),
    )  # fmt: skip
    async with bench_stack("realengine-") as st:
        url = await st.cluster(masters=3, replicas=1, url=f.redis)
        redis = connect(url)
        st.on_exit(redis.aclose)
        await redis.initialize()
        return await run(cfg, built, redis, url)


def _run(f: Flags) -> Outcome:
    built = find()
    if built is None:
        why = missing_toolchain() or "llama-server is not built: python -m devstack llama build"
        return Outcome({"skipped": why}, f"skipped: {why}", 2)
    unknown = set(f.policies.split(",")) - set(POLICIES)
    if unknown:
        return Outcome({}, f"unknown policies: {', '.join(sorted(unknown))}", 2)
    res = asyncio.run(_main(f, built))
    bad = sum(r["errors"] for per in res["slots"].values() for r in per.values())
    return Outcome(res, table(res), 1 if bad else 0)


BENCH = Bench(Flags, _run, prog="python -m bench.routing.realengine", description=__doc__,
              quick_help="6 sessions x 3 turns, 2 slots, cost_aware and round robin")  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
