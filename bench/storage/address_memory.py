"""The most Redis memory one client address can make the cluster hold, with the default
flags: a hostile benchmark.

What it answers: what does the cluster hold after one address has done its worst for an
hour? A stack as ``python -m devstack demo`` runs it (``devstack.demo.stack``: a local Redis
Cluster of 3 masters + 3 replicas, 2 workers with **every limit at its default**, mock
engines) and one attacker behind the workers' trusted proxy, always the same address
(``X-Forwarded-For``). The engines are the attacker's best case, not the service's: every
reply is ``--max-tokens-limit`` (4,096) tokens long and streamed at once (the mock
engine with ``--decode-tok-per-s 0`` and a fixed reply length).

Phases:

1. **sessions**: ``POST /v1/sessions`` on the workers in turn until refused with
   ``too_many_sessions`` (the live-session cap per address, counted in Redis) or
   ``--max-creations``; the ``session_rate`` 429s on the way are waited out.
2. **fill**: ``--fill`` of those sessions get ``--turns`` turns each, all at once, each
   with a message of ``--message-chars`` (the body limit allows 32,768 ASCII
   characters), ``max_tokens`` 4,096 and a fresh ``Idempotency-Key`` of 128 characters
   (each one a record kept an hour); ``turn_rate`` and ``engines_full`` 429s are waited
   out, a 409 (the session's previous turn still ending) is retried.
3. **measure**: ``MEMORY USAGE <key> SAMPLES 0`` of every key of every session (backlog,
   meta hash, history, its state, idempotency records, lock and rate counters) and of
   the address's session set, and ``INFO memory``
   ``used_memory`` of every master and replica, against the same before phase 1.

The hour is **extrapolated**, and the result says from what. A session stops growing
at its bounds: its backlog at ``--backlog-max-bytes`` (4 MiB) or ``--backlog-maxlen``
(10,000 frames), whichever comes first, its history at ``--history-max-bytes`` (1 MiB),
its idempotency records at an hour of ``--turns-per-minute`` turns (1,800).
The worst case for the service is frames large enough that the byte budget binds; the
most one session can hold is projected there, from the bytes Redis used per byte of
frames and of history on the filled sessions (what the fullest of them holds is measured
too: with the mock's small frames the frame bound comes first). The address holds at
most ``cap`` sessions (64) for ``--session-ttl-s`` (24 h) after their creation, so
``cap x`` that, plus the address's own set, is a **ceiling** nothing it does passes.
The most per hour is that ceiling; this run's growth per second x 3,600 is reported
beside it as a lower estimate (``--fill`` sessions at once; 64 at once grow faster).
A quick run fills 2 sessions to their bounds (40 turns each: past one clock minute of
``--turns-per-minute``); ``--fill 64`` fills the cap. Idempotency records are the one
store that grows with time rather than to a size: the ceiling counts the 1,800 a session
can hold at once, from the bytes one of them used here.

Order of use: ``python -m bench.storage.address_memory [--quick] [--json PATH] [--seed N]``
(``run_from_args``), or ``await run(cfg)`` -> dict.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from bench.harness import Bench, Common, Outcome, flag
from devstack.demo.stack import Stack, StackSpec
from relay.protocol.keys import (
    BACKLOG_MAX_BYTES,
    BACKLOG_MAXLEN,
    SESSION_TTL_S,
    address_sessions_key,
    hist_key,
    log_key,
    meta_key,
)
from worker.chat.store import IDEM_TTL_S, state_key

__all__ = ["AttackConfig", "add_arguments", "main", "run", "run_from_args"]

ATTACKER = "198.51.100.23"  # one address, behind the workers' trusted proxy (127.0.0.1)
HISTORY_MAX_BYTES = 1 << 20  # the worker's default --history-max-bytes
SESSION_CAP = 64  # the worker's default --max-sessions-per-address
MAX_TOKENS = 4096  # the worker's default --max-tokens-limit
TURNS_PER_MINUTE = 30  # the worker's default --turns-per-minute


@dataclass(frozen=True)
class AttackConfig:
    workers: int = 2
    engines: int = 3
    max_creations: int = 200  # stop phase 1 here if the cap never refuses
    fill: int = 64  # sessions that get turns
    turns: int = 60  # turns per filled session
    message_chars: int = 32_768
    seed: int = 7
    turn_timeout_s: float = 120.0


class AttackError(RuntimeError):
    """The attack met an answer it does not know how to wait out."""


async def _post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any] | None = None, **headers: str
) -> tuple[int, dict[str, Any], float]:
    hdrs = {"X-Forwarded-For": ATTACKER, **headers}
    kw: dict[str, Any] = {"headers": hdrs}
    if body is not None:
        kw["data"] = json.dumps(body, ensure_ascii=False).encode()
        hdrs["Content-Type"] = "application/json"
    async with http.post(url, **kw) as r:
        text = await r.text()
        try:
            got = json.loads(text)
        except ValueError:
            got = {"error": "not_json", "reason": text[:200]}
        return r.status, got, float(r.headers.get("Retry-After", "0") or 0)


async def _create_sessions(
    http: aiohttp.ClientSession, workers: list[str], cfg: AttackConfig
) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Phase 1: sessions until the cap refuses; (sid, token) each, and what was seen."""
    made: list[tuple[str, str]] = []
    seen: dict[str, int] = {}
    refused_by: str | None = None
    t0 = time.monotonic()
    i = 0
    while len(made) < cfg.max_creations:
        status, body, retry = await _post(http, workers[i % len(workers)] + "/v1/sessions")
        i += 1
        if status == 201:
            made.append((body["session"], body["token"]))
            continue
        code = str(body.get("error"))
        seen[code] = seen.get(code, 0) + 1
        if code == "too_many_sessions":
            refused_by = code
            break
        if code != "session_rate":
            raise AttackError(f"POST /v1/sessions: {status} {body}")
        if seen[code] % len(workers) == 0:  # every worker's bucket is empty: wait one out
            await asyncio.sleep(min(retry, 1.0))
    return made, {
        "created": len(made),
        "refused_by": refused_by,
        "refusals": seen,
        "seconds": round(time.monotonic() - t0, 1),
    }


async def _fill_one(
    http: aiohttp.ClientSession,
    workers: list[str],
    sid: str,
    token: str,
    cfg: AttackConfig,
    rng: random.Random,
    waits: dict[str, int],
) -> int:
    """Phase 2 for one session: ``cfg.turns`` accepted turns; how many were accepted."""
    alphabet = "abcdefghijklmnopqrstuvwxyz "
    accepted = 0
    deadline = time.monotonic() + cfg.turn_timeout_s * cfg.turns
    while accepted < cfg.turns:
        if time.monotonic() > deadline:
            raise AttackError(f"session {sid}: {accepted} turns accepted before the deadline")
        message = "".join(rng.choices(alphabet, k=cfg.message_chars))
        url = f"{rng.choice(workers)}/v1/sessions/{sid}/turns"
        body = {"message": message, "max_tokens": MAX_TOKENS}
        idem = f"{accepted:04d}" + rng.choice(alphabet[:26]) * 124  # the longest key, fresh
        status, got, retry = await _post(
            http, url, body, Authorization=f"Bearer {token}", **{"Idempotency-Key": idem}
        )
        if status == 202:
            accepted += 1
            continue
        code = str(got.get("error"))
        waits[code] = waits.get(code, 0) + 1
        if status == 409:  # the previous turn still ends: a moment
            await asyncio.sleep(0.05)
        elif status == 429 and code in ("turn_rate", "engines_full"):
            await asyncio.sleep(max(retry, 0.1))
        else:
            raise AttackError(f"turn of {sid}: {status} {got}")
    return accepted


async def _memory(nodes: list[tuple[str, int, str]]) -> dict[str, int]:
    """``used_memory`` of every node, by ``host:port role``."""
    out: dict[str, int] = {}
    for host, port, role in nodes:
        r = aioredis.Redis(host=host, port=port)
        try:
            info = await r.info("memory")
            out[f"{host}:{port} {role}"] = int(info["used_memory"])
        finally:
            await r.aclose()
    return out


async def _usage(redis: aioredis.RedisCluster, name: str) -> int:
    got = await redis.execute_command("MEMORY", "USAGE", name, "SAMPLES", "0")
    return int(got or 0)


async def _session_bytes(redis: aioredis.RedisCluster, sid: str) -> dict[str, int]:
    """What Redis uses for one session's keys, and the bytes of frames and history in
    them (what the budgets count)."""
    entries: Any = await redis.execute_command("XRANGE", log_key(sid), "-", "+")
    history: Any = await redis.execute_command("LRANGE", hist_key(sid), 0, -1)
    named = {log_key(sid), meta_key(sid), hist_key(sid), state_key(sid)}
    idem = other = records = 0
    async for name in redis.scan_iter(match=f"tr:{{{sid}}}:*", count=1000):
        text = name.decode() if isinstance(name, bytes) else str(name)
        if text in named:
            continue
        if text.startswith(f"tr:{{{sid}}}:idem:"):
            idem += await _usage(redis, text)
            records += 1
        else:  # the turn lock, the turn-rate counters: seconds to minutes of TTL
            other += await _usage(redis, text)
    return {
        "log": await _usage(redis, log_key(sid)),
        "meta": await _usage(redis, meta_key(sid)),
        "hist": await _usage(redis, hist_key(sid)),
        "state": await _usage(redis, state_key(sid)),
        "idem": idem,
        "other": other,
        "frame_bytes": sum(len(fields[b"f"]) for _, fields in entries),
        "frames": len(entries),
        "history_bytes": sum(len(h) for h in history),
        "idem_records": records,
    }


def _keys_total(s: dict[str, int]) -> int:
    return s["log"] + s["meta"] + s["hist"] + s["state"] + s["idem"] + s["other"]


def _project(filled: list[dict[str, int]]) -> dict[str, Any]:
    """The most one session can hold: at its byte budgets (the worst case: frames large
    enough that the backlog's byte budget binds before its 10,000 frames do), projected
    from the bytes Redis used per byte of frames and of history on the filled sessions;
    and what the fullest filled session holds, measured, with the reason it stopped
    growing (``maxlen``: the mock's small frames reached the frame bound first)."""
    fullest = max(filled, key=_keys_total)
    log_ratio = max(s["log"] / s["frame_bytes"] for s in filled if s["frame_bytes"])
    hist_ratio = max(s["hist"] / s["history_bytes"] for s in filled if s["history_bytes"])
    # Idempotency-Key records live IDEM_TTL_S: at most that long's turns per session
    per_record = max(x["idem"] / x["idem_records"] for x in filled if x["idem_records"])
    idem_records = TURNS_PER_MINUTE * IDEM_TTL_S / 60
    worst = int(
        log_ratio * BACKLOG_MAX_BYTES + hist_ratio * HISTORY_MAX_BYTES
        + per_record * idem_records + fullest["meta"] + fullest["state"] + fullest["other"]
    )  # fmt: skip
    bound = "bytes" if fullest["frame_bytes"] >= 0.9 * BACKLOG_MAX_BYTES else (
        "maxlen" if fullest["frames"] >= 0.9 * BACKLOG_MAXLEN else None)  # fmt: skip
    return {
        "per_session_worst_bytes": worst,
        "per_session_measured_bytes": _keys_total(fullest),
        "measured_session_stopped_at": bound,  # None: it was still growing
        "history_full": fullest["history_bytes"] >= 0.9 * HISTORY_MAX_BYTES,
        "log_bytes_per_frame_byte": round(log_ratio, 3),
        "hist_bytes_per_history_byte": round(hist_ratio, 3),
        "idem_bytes_per_record": int(per_record),
        "idem_records_per_session_at_most": int(idem_records),
    }


async def run(cfg: AttackConfig) -> dict[str, Any]:
    """Start the stack, attack it, measure it; the result (see the module docstring)."""
    rng = random.Random(cfg.seed)
    engine_args = ["--decode-tok-per-s", "0", "--prefill-tok-per-s", "0",
                   "--reply-min-tokens", str(MAX_TOKENS), "--reply-mean-tokens", str(MAX_TOKENS),
                   "--reply-max-tokens", str(MAX_TOKENS)]  # fmt: skip
    spec = StackSpec(relays=0, workers=cfg.workers, engines=cfg.engines, engine_args=engine_args)
    async with Stack(spec) as stack, aiohttp.ClientSession() as http:
        assert stack.cluster_info is not None
        nodes = [(n.host, n.port, n.role) for n in stack.cluster_info.nodes]
        redis = aioredis.RedisCluster.from_url(stack.redis_url)
        await redis.initialize()
        try:
            before = await _memory(nodes)
            made, sessions = await _create_sessions(http, stack.worker_urls, cfg)
            waits: dict[str, int] = {}
            targets = made[: cfg.fill]
            t0 = time.monotonic()
            turns = await asyncio.gather(
                *(
                    _fill_one(
                        http, stack.worker_urls, sid, tok, cfg, random.Random(rng.random()), waits
                    )
                    for sid, tok in targets
                )
            )
            await asyncio.sleep(1.0)  # the last turns' frames
            fill_s = time.monotonic() - t0
            filled = [await _session_bytes(redis, sid) for sid, _ in targets]
            rest = [await _session_bytes(redis, sid) for sid, _ in made[cfg.fill :]]
            address_set = await _usage(redis, address_sessions_key(ATTACKER))
            after = await _memory(nodes)
        finally:
            await redis.aclose()
    masters = [k for k in before if k.endswith("master")]
    grew = {k: after[k] - before[k] for k in before}
    held_now = sum(_keys_total(s) for s in filled + rest) + address_set
    per = _project(filled)
    cap = sessions["created"]
    ceiling = cap * per["per_session_worst_bytes"] + address_set
    fullest = max(filled, key=_keys_total)  # and the idempotency records it could hold
    idem_more = (per["idem_records_per_session_at_most"] - fullest["idem_records"]) * per[
        "idem_bytes_per_record"
    ]
    ceiling_mock = cap * (per["per_session_measured_bytes"] + max(idem_more, 0)) + address_set
    # what the attacker added per second here, with --fill sessions at once (64 at once
    # would add it faster, never slower): the hour's growth if it kept this pace
    rate = sum(_keys_total(x) for x in filled) / max(fill_s, 1e-9)
    pace_hour = min(ceiling, int(rate * 3600))
    per_turn = sum(_keys_total(x) for x in filled) / max(sum(turns), 1)
    return {
        "config": asdict(cfg),
        "defaults": {
            "max_sessions_per_address": SESSION_CAP,
            "backlog_max_bytes": BACKLOG_MAX_BYTES,
            "history_max_bytes": HISTORY_MAX_BYTES,
            "session_ttl_s": SESSION_TTL_S,
            "turns_per_minute": TURNS_PER_MINUTE,
        },
        "sessions": sessions,
        "fill": {
            "sessions": len(targets),
            "turns_accepted": sum(turns),
            "seconds": round(fill_s, 1),
            "waits": waits,
            "bytes_per_turn": int(per_turn),
            "turns_per_s": round(sum(turns) / max(fill_s, 1e-9), 2),
        },
        "measured": {
            "keys_bytes": held_now,
            "used_memory_growth_masters": sum(grew[k] for k in masters),
            "used_memory_growth_all_nodes": sum(grew.values()),
            "fullest_session": max(filled, key=_keys_total),
            "address_set_bytes": address_set,
        },
        "hour": {
            **per,
            "sessions_at_cap": cap,
            "ceiling_bytes": ceiling,
            "ceiling_with_these_frames_bytes": ceiling_mock,
            "growth_bytes_per_s": int(rate),
            "minutes_to_ceiling_at_this_pace": round(ceiling / max(rate, 1) / 60, 1),
            "most_per_hour_bytes": ceiling,
            "this_pace_for_an_hour_bytes": pace_hour,
            "extrapolated": True,
            "how": "the most per hour is the ceiling: cap x the most one session can hold "
            "at its byte budgets (projected from the bytes Redis used per byte of frames "
            "and history here) + the address's session set; nothing the address does "
            "passes it while its sessions count (session-ttl-s after creation). This run's "
            "pace for an hour (growth per second x 3600, at most the ceiling) is a lower "
            "estimate: --fill sessions at once, more at once grow faster. Masters only: "
            "replicas hold a copy each.",
        },
    }


def _table(res: dict[str, Any]) -> str:
    mib = 1 << 20
    h, m, s, f = res["hour"], res["measured"], res["sessions"], res["fill"]
    return "\n".join([
        f"sessions: {s['created']} created, then {s['refused_by']} (refusals {s['refusals']})",
        f"fill: {f['turns_accepted']} turns on {f['sessions']} sessions in {f['seconds']} s, "
        f"{f['bytes_per_turn']} B per turn",
        f"measured: keys {m['keys_bytes'] / mib:.1f} MiB, used_memory +"
        f"{m['used_memory_growth_masters'] / mib:.1f} MiB (masters); fullest session "
        f"{h['per_session_measured_bytes'] / mib:.2f} MiB (stopped at "
        f"{h['measured_session_stopped_at']})",
        f"per session at its byte budgets (projected): {h['per_session_worst_bytes'] / mib:.2f} "
        "MiB",
        f"ceiling of one address: {h['ceiling_bytes'] / mib:.0f} MiB on the masters "
        f"({h['ceiling_with_these_frames_bytes'] / mib:.0f} MiB with these frames)",
        f"one hour (extrapolated): at most {h['most_per_hour_bytes'] / mib:.0f} MiB (the "
        f"ceiling); this run's pace: {h['this_pace_for_an_hour_bytes'] / mib:.0f} MiB in an "
        f"hour, the ceiling in {h['minutes_to_ceiling_at_this_pace']} min",
    ])  # fmt: skip


_D = AttackConfig()


@dataclass
class Flags(Common):
    workers: int = flag(_D.workers, "workers", least=1)
    engines: int = flag(_D.engines, "mock engines", least=1)
    fill: int = flag(_D.fill, "sessions that get turns", quick=2, least=0)
    turns: int = flag(_D.turns, "turns per filled session", quick=40, least=0)
    message_chars: int = flag(_D.message_chars, "characters per message", least=1)
    max_creations: int = flag(_D.max_creations, "stop creating sessions here", least=1)
    seed: int = flag(_D.seed, "the messages' text")


def _run(f: Flags) -> Outcome:
    cfg = AttackConfig(workers=f.workers, engines=f.engines, fill=f.fill, turns=f.turns,
                       message_chars=f.message_chars, max_creations=f.max_creations,
                       seed=f.seed)  # fmt: skip
    res = asyncio.run(run(cfg))
    return Outcome(
        res, _table(res), 0 if res["sessions"]["refused_by"] == "too_many_sessions" else 1
    )


BENCH = Bench(Flags, _run, prog="python -m bench.storage.address_memory", description=__doc__,
              quick_help="2 sessions x 40 turns: filled to their budgets (~2 minutes)")  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
