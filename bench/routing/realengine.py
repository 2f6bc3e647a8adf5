"""Routing on real engines: llama.cpp's ``llama-server`` (SmolLM2-135M on the CPU) under
the worker's routing policies, prefill counted by the engines themselves.

What it answers: on engines with a real prefix cache (llama.cpp's slots, each holding one
conversation's tokens, and behind them, unless ``--cache-ram 0``, the server's host-memory
prompt cache), how much prompt do the engines compute, how much of each prompt do they
reuse, and how long do screens wait for the first token, under ``cost_aware``, ``ring``
(sticky: a session's key always to the same engine) and ``round_robin``, at each slot
count (``--slots``) and number of conversations at once (``--live``)? For each it starts
fresh servers (empty caches; ``devstack.llama.serve``) and two workers as processes
(``devstack.demo.stack``, the load exchange on), then drives ``--sessions`` conversations
of ``--turns`` turns, ``live`` of them at once, each next turn sent the moment the reply
ends, each request posted to a worker drawn at random (no stickiness, no period) and
waited for in the session's backlog. Figures:

- **computed prompt tokens**: the sum of the engines' ``llamacpp:prompt_tokens_total``
  (tokens they prefilled; a reused prefix is not counted), and its ratio to round robin;
- **reused %**: the share of the turns' prompt tokens the engines reported as cached
  (``done`` meta, from their ``timings``);
- **evicted follow-ups**: turns after a session's first whose engine reused less than
  the previous turn's prompt (its slot had been given to another conversation, or the
  turn went to another engine); **moved follow-ups**: those on another engine than the
  session's previous turn;
- **TTFT** p50/p90 of the screens (the ``done`` meta's ``ttft_ms``), errors;
- the engines' own prefill and decode rates (``llamacpp:prompt_tokens_seconds``,
  ``llamacpp:predicted_tokens_seconds``);
- in the JSON, every turn: session, turn, engine, prompt tokens, cached tokens, TTFT.

``--merge A,B`` writes one result of runs measured apart (a later one replaces an earlier
one at the same slots, live and policy); ``--report PATH`` prints a stored one's table.
Needs the built engine (``python -m devstack llama build``); without it, one line saying
why and exit 2. ``python -m bench.routing.realengine [--quick] [--json PATH] [--seed N]``.
"""

from __future__ import annotations

import asyncio
import random
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
from redis.asyncio import RedisCluster

from bench._util import percentile
from bench.harness import Bench, OnCluster, Outcome, bench_stack, flag
from bench.harness.report import logger, read_result
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
    sessions: int = 16
    turns: int = 4
    live: tuple[int, ...] = (4, 8)  # sessions at once, one run per level
    engines: int = 2
    slots: tuple[int, ...] = (1, 2, 4)
    policies: tuple[str, ...] = POLICIES
    ctx_per_slot: int = 2048
    threads: int = 1
    max_tokens: int = 12
    message_words: int = 20
    system_words: int = 60
    system_prompts: int = 2
    # the engines' host-memory prompt cache in MiB (llama-server --cache-ram): None is the
    # server's default (8 GiB: it keeps the conversations its slots gave up), 0 none
    cache_ram_mib: int | None = None
    turn_timeout_s: float = 300.0
    seed: int = 7


@dataclass
class _Figures:
    ttft_ms: list[float] = field(default_factory=list)
    prompt: int = 0
    cached: int = 0
    follow_ups: int = 0
    evicted: int = 0
    moved: int = 0  # follow-ups on another engine than the session's previous turn
    # every turn: [session, turn, engine, prompt tokens, cached tokens, TTFT ms]
    log: list[list[Any]] = field(default_factory=list)
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
        self._pick = random.Random(cfg.seed)

    def _worker(self) -> str:
        """A worker drawn at random for each request: no stickiness, and no period. (Taking
        the workers in turn made round robin sticky: with 4 or 8 conversations cycling
        through 2 workers, each alternating over 2 engines, every conversation's next
        turn came back to the engine of its last.)"""
        return self._pick.choice(self.stack.worker_urls)

    async def session(
        self, http: aiohttp.ClientSession, rng: random.Random, system: str, n: int = 0
    ) -> None:
        async with http.post(f"{self._worker()}/v1/sessions") as r:
            if r.status != 201:
                self.fig.errors.append(f"POST session {r.status}")
                return
            sid = (await r.json())["session"]
        prev_prompt, prev_engine = 0, None
        for i in range(self.cfg.turns):
            body = {"message": _text(rng, self.cfg.message_words), "system": system,
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
            self.fig.log.append([n, i, meta.get("engine"), prompt, cached, ttft])
            if isinstance(prompt, int) and isinstance(cached, int):
                self.fig.prompt += prompt
                self.fig.cached += cached
                if i > 0:
                    self.fig.follow_ups += 1
                    if cached < prev_prompt - _BLOCK:
                        self.fig.evicted += 1
                    if meta.get("engine") != prev_engine:
                        self.fig.moved += 1
                prev_prompt = prompt
            prev_engine = meta.get("engine")

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
    cfg: RealEngineConfig,
    built: Built,
    redis: RedisCluster,
    url: str,
    slots: int,
    live: int,
    policy: str,
) -> dict[str, Any]:
    rng = random.Random(cfg.seed)  # the same conversations under every policy
    systems = [
        f"You are assistant {i}. " + _text(rng, cfg.system_words) for i in range(cfg.system_prompts)
    ]
    with tempfile.TemporaryDirectory(prefix="realengine-") as logs:
        ctx = slots * cfg.ctx_per_slot
        engines = llama_servers(built, cfg.engines, logs, slots=slots, ctx=ctx,
                                threads=cfg.threads, cache_ram_mib=cfg.cache_ram_mib)  # fmt: skip
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
                gate = asyncio.Semaphore(live)

                async def one(i: int) -> None:
                    async with gate:
                        await run.session(http, random.Random(cfg.seed * 1000 + i),
                                          systems[i % len(systems)], i)  # fmt: skip

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
        "moved_follow_ups": f.moved,
        "ttft_p50_ms": percentile(f.ttft_ms, 0.5),
        "ttft_p90_ms": percentile(f.ttft_ms, 0.9),
        "turns": f.turns,
        "errors": len(f.errors),
        "error_samples": f.errors[:5],
        "engine_prefill_tok_s": round(prefill_rate, 1),
        "engine_decode_tok_s": round(decode_rate, 1),
        "wall_s": round(wall, 1),
        "turn_log": f.log,
    }


def _vs_round_robin(runs: list[dict[str, Any]]) -> None:
    """Each run's computed prompt tokens against round robin's at its slots and live."""
    rr = {(r["slots"], r["live"]): r["computed_prompt_tokens"] for r in runs
          if r["policy"] == "round_robin"}  # fmt: skip
    for r in runs:
        base = rr.get((r["slots"], r["live"]))
        r["vs_round_robin"] = round(r["computed_prompt_tokens"] / base, 2) if base else None


_SAME = ("sessions", "turns", "engines", "threads", "max_tokens", "message_words",
         "system_words", "system_prompts", "cache_ram_mib", "seed")  # fmt: skip


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs of several results with the same settings (policies measured one at a time)
    as one result, ordered by slots, live, then policy; a later result's run replaces an
    earlier one's at the same slots, live and policy; ValueError when settings differ."""
    first = results[0]["config"]
    for res in results[1:]:
        diff = [k for k in _SAME if res["config"].get(k) != first.get(k)]
        if diff:
            raise ValueError(f"the results differ in {', '.join(diff)}")
    # a later result's run replaces an earlier one's at the same slots, live and policy
    # (a policy measured again after a change)
    latest = {(r["slots"], r["live"], r["policy"]): r for res in results for r in res["runs"]}
    runs = list(latest.values())
    order = {p: i for i, p in enumerate(POLICIES)}
    runs.sort(key=lambda r: (r["slots"], r["live"], order.get(r["policy"], len(order))))
    _vs_round_robin(runs)
    policies = sorted({r["policy"] for r in runs}, key=lambda p: order.get(p, len(order)))
    cfg = {**first, "slots": sorted({r["slots"] for r in runs}),
           "live": sorted({r["live"] for r in runs}), "policies": policies}  # fmt: skip
    return {"config": cfg, "runs": runs}


async def run(
    cfg: RealEngineConfig,
    built: Built,
    redis: RedisCluster,
    url: str,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Every slot count x live level x policy; ``out["runs"]`` lists them in that order."""
    out: dict[str, Any] = {"config": asdict(cfg), "runs": []}
    for slots in cfg.slots:
        for live in cfg.live:
            per: dict[str, dict[str, Any]] = {}
            for policy in cfg.policies:
                log(f"{slots} slots, {live} live, {policy}")
                r = await run_one(cfg, built, redis, url, slots, live, policy)
                per[policy] = {"slots": slots, "live": live, "policy": policy, **r}
                log(f"  {r['computed_prompt_tokens']} computed, {r['wall_s']} s")
            out["runs"].extend(per.values())
    _vs_round_robin(out["runs"])
    return out


def table(res: dict[str, Any]) -> str:
    """The Markdown table of a result (also ``--report PATH`` of a stored one)."""
    c = res["config"]
    ram = c.get("cache_ram_mib")
    cache = "the server's default prompt cache" if ram is None else f"--cache-ram {ram}"
    lines = [
        f"{c['sessions']} sessions x {c['turns']} turns, {c['engines']} llama-server engines "
        f"(SmolLM2-135M Q4_1, {c['threads']} CPU thread each, {cache}), max_tokens "
        f"{c['max_tokens']}, seed {c['seed']}",
        "",
        "| slots | live | routing | computed prompt tokens | vs round robin | reused | evicted "
        "follow-ups | moved follow-ups | TTFT p50 | TTFT p90 | errors |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["runs"]:
        lines.append(
            f"| {r['slots']} | {r['live']} | {r['policy']} | {r['computed_prompt_tokens']:,} | "
            f"{r['vs_round_robin']}x | {r['reused_pct']} % | "
            f"{r['evicted_follow_ups']} of {r['follow_ups']} | "
            f"{r.get('moved_follow_ups', 0)} | "
            f"{(r['ttft_p50_ms'] or 0) / 1000:.2f} s | {(r['ttft_p90_ms'] or 0) / 1000:.2f} s "
            f"| {r['errors']} |"
        )
    rates = [(r["engine_prefill_tok_s"], r["engine_decode_tok_s"]) for r in res["runs"]]
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
    live: str = flag("4,8", "conversations at once, comma-separated levels", quick="2")
    slots: str = flag("1,2,4", "slots per engine, comma-separated (llama-server -np)", quick="2")
    max_tokens: int = flag(_D.max_tokens, "reply tokens per turn", least=1)
    merge: str = flag("", "no run: put the --json results at these comma-separated paths "
                      "(the same settings, policies run apart) into one; a later path's run "
                      "replaces an earlier one's at the same slots, live and policy")  # fmt: skip
    cache_ram: int = flag(-2, "the engines' prompt cache in MiB (llama-server --cache-ram; "
                          "0: none; -2: the server's default)", least=-2)  # fmt: skip
    policies: str = flag(",".join(POLICIES), "routing policies, comma-separated",
                         quick="cost_aware,round_robin")  # fmt: skip
    threads: int = flag(_D.threads, "CPU threads per engine", least=1)
    seed: int = flag(_D.seed, "the conversations' prompts")


async def _main(f: Flags, built: Built) -> dict[str, Any]:
    cfg = RealEngineConfig(
        sessions=f.sessions, turns=f.turns, threads=f.threads, seed=f.seed,
        live=_ints(f.live), slots=_ints(f.slots), max_tokens=f.max_tokens,
        policies=tuple(p for p in f.policies.split(",") if p),
        cache_ram_mib=None if f.cache_ram == -2 else f.cache_ram,
    )  # fmt: skip
    async with bench_stack("realengine-") as st:
        url = await st.cluster(masters=3, replicas=1, url=f.redis)
        redis = connect(url)
        st.on_exit(redis.aclose)
        await redis.initialize()
        return await run(cfg, built, redis, url, logger("realengine"))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(s) for s in text.split(",") if s.strip())


def _run(f: Flags) -> Outcome:
    if f.merge:
        try:
            res = merge([read_result(p) for p in f.merge.split(",") if p])
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            return Outcome({}, f"cannot merge: {exc}", 2)
        return Outcome(res, table(res), 0)
    built = find()
    if built is None:
        why = missing_toolchain() or "llama-server is not built: python -m devstack llama build"
        return Outcome({"skipped": why}, f"skipped: {why}", 2)
    unknown = set(f.policies.split(",")) - set(POLICIES)
    if unknown:
        return Outcome({}, f"unknown policies: {', '.join(sorted(unknown))}", 2)
    try:
        levels = [*_ints(f.live), *_ints(f.slots)]
    except ValueError:
        return Outcome({}, "--live and --slots want comma-separated whole numbers", 2)
    if not levels or min(levels) < 1:
        return Outcome({}, "--live and --slots want numbers >= 1", 2)
    res = asyncio.run(_main(f, built))
    bad = sum(r["errors"] for r in res["runs"])
    return Outcome(res, table(res), 1 if bad else 0)


BENCH = Bench(Flags, _run, prog="python -m bench.routing.realengine", description=__doc__,
              quick_help="6 sessions x 3 turns, 2 live, 2 slots, cost_aware and round robin",
              markdown=table)  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
