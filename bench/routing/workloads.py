"""Workloads for the routing simulator: a real trace, a synthetic chat mix and a pulse.

Every workload is a list of :class:`Request` sorted by arrival. A request carries its
prompt as a chain of prefix-block ids (equal ids = the same prefix, so reusable KV cache),
its conversation id and its routing key.

- :func:`load_trace` reads the Mooncake format (one JSON object a line: ``timestamp`` in
  ms, ``input_length``, ``output_length``, ``hash_ids``: 512-token blocks). Conversation:
  a request whose first two blocks equal an earlier request's continues that request's
  conversation (in the bundled trace every request starts with block 0, one shared
  system prompt, and the second block is the conversation's own; a later turn's chain
  extends the earlier one, sharing a median 92 % of its blocks). Routing key: the first
  ``key_blocks`` (2) block ids, the analogue of the worker's "system prompt + first user
  message" key (``worker/routing/key.py``).
- :func:`scale` replays a trace at another rate: arrival times divided by a factor, each
  nudged by a seeded jitter of up to ``jitter_s`` of trace time (so seeds differ).
- :func:`synthetic`: Poisson sessions over Zipf-popular system prompts, multi-turn with
  think time and growing history. :func:`pulse`: the synthetic mix plus a burst of
  sessions on one hot system prompt (the article's hospital: hundreds of doctors with
  the same long system prompt at once). :data:`SHARED_PREFIX`: the synthetic mix shaped
  like llm-d's precise-prefix-cache benchmark (150 groups of users behind 6k-token
  prefixes, every group as popular, 1,000-1,400-token questions, five turns on average):
  the prefixes alone (920k tokens) fill more than two engines' KV caches, so an engine's
  cache churns and where a prefix still is cannot be told from past decisions alone.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

__all__ = [
    "SHARED_PREFIX",
    "Request",
    "TraceError",
    "load_trace",
    "pulse",
    "scale",
    "synthetic",
]

BLOCK_TOKENS: Final = 512
_SYS_BASE: Final = 1 << 40  # synthetic block ids: system prompts live above this


class TraceError(ValueError):
    """A trace line that is not a request (the message names the line)."""


@dataclass(frozen=True, slots=True)
class Request:
    rid: int
    t: float  # arrival, seconds
    ids: tuple[int, ...]
    prompt: int
    out: int
    conv: int
    key: str
    turn: int = 0  # 0 for a conversation's first request
    shared: int = BLOCK_TOKENS  # tokens of the prefix shared across conversations (system)


def _conversations(
    raw: Iterable[tuple[float, tuple[int, ...], int, int]], key_blocks: int
) -> list[Request]:
    convs: dict[tuple[int, ...], tuple[int, int]] = {}
    out: list[Request] = []
    for rid, (t, ids, prompt, gen) in enumerate(raw):
        head = ids[:2]
        conv, turn = convs.get(head, (len(convs), -1))
        convs[head] = (conv, turn + 1)
        key = ":".join(str(b) for b in ids[:key_blocks])
        out.append(Request(rid, t, ids, prompt, gen, conv, key, turn + 1))
    return out


def load_trace(path: str | Path, *, key_blocks: int = 2, limit: int = 0) -> list[Request]:
    """Read a Mooncake-format trace; ``limit`` > 0 keeps its first ``limit`` requests."""
    raw: list[tuple[float, tuple[int, ...], int, int]] = []
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{p}: cannot read the trace ({exc.strerror})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            o = json.loads(line)
            t = float(o["timestamp"]) / 1000.0
            prompt, gen = int(o["input_length"]), int(o["output_length"])
            ids = tuple(int(b) for b in o["hash_ids"])
        except (ValueError, KeyError, TypeError) as exc:
            raise TraceError(f"{p}:{n}: not a trace request ({exc!r})") from None
        if prompt < 1 or gen < 1 or not ids or t < 0:
            raise TraceError(
                f"{p}:{n}: needs input_length, output_length >= 1, hash_ids, timestamp >= 0"
            )
        raw.append((t, ids, prompt, gen))
        if limit and len(raw) >= limit:
            break
    if not raw:
        raise TraceError(f"{p}: no requests")
    raw.sort(key=lambda r: r[0])
    return _conversations(raw, key_blocks)


def scale(reqs: list[Request], factor: float, *, seed: int, jitter_s: float = 1.0) -> list[Request]:
    """Arrivals ``factor`` times as fast (times divided by ``factor``), each request moved
    by a seeded uniform jitter in [0, ``jitter_s``) of trace time; order kept per
    conversation (a later turn never overtakes an earlier one)."""
    if factor <= 0:
        raise ValueError("factor must be > 0")
    rng = random.Random(f"{seed}:jitter")
    last: dict[int, float] = {}
    out: list[Request] = []
    t0 = reqs[0].t if reqs else 0.0
    for r in reqs:
        t = (r.t - t0 + rng.random() * jitter_s) / factor
        t = max(t, last.get(r.conv, -1.0) + 1e-6)
        last[r.conv] = t
        out.append(replace(r, t=t))
    out.sort(key=lambda r: (r.t, r.rid))
    return out


@dataclass(frozen=True, slots=True)
class SynthConfig:
    rate: float = 2.0  # new sessions per second
    duration_s: float = 600.0
    system_prompts: int = 40
    zipf: float = 1.2
    sys_blocks: tuple[int, int] = (2, 8)  # system prompt length, blocks
    mean_turns: float = 4.0
    think_s: float = 30.0
    msg_tokens: tuple[int, int] = (50, 600)
    out_tokens: tuple[int, int] = (50, 500)


SHARED_PREFIX: Final = SynthConfig(
    system_prompts=150,
    zipf=0.0,
    sys_blocks=(12, 12),
    mean_turns=5.0,
    msg_tokens=(1000, 1400),
    out_tokens=(100, 400),
)


def synthetic(
    cfg: SynthConfig, *, seed: int, start_rid: int = 0, start_conv: int = 0
) -> list[Request]:
    """Multi-turn chat sessions: see the module docstring. Deterministic per ``seed``."""
    rng = random.Random(f"{seed}:synthetic")
    sys_rng = random.Random(f"{seed}:systems")
    sys_len = [sys_rng.randint(*cfg.sys_blocks) for _ in range(cfg.system_prompts)]
    cum = list(itertools.accumulate(1.0 / (i + 1) ** cfg.zipf for i in range(cfg.system_prompts)))
    starts: list[float] = []
    t = rng.expovariate(cfg.rate)
    while t < cfg.duration_s:
        starts.append(t)
        t += rng.expovariate(cfg.rate)
    sessions = []
    for i, t0 in enumerate(starts):
        srng = random.Random(f"{seed}:session:{start_conv + i}")
        k = bisect.bisect_right(cum, srng.random() * cum[-1])
        sessions.append((t0, k, srng))
    return _turns(cfg, sessions, sys_len, start_rid, start_conv)


def _turns(
    cfg: SynthConfig,
    sessions: list[tuple[float, int, random.Random]],
    sys_len: list[int],
    start_rid: int,
    start_conv: int,
) -> list[Request]:
    fresh = itertools.count(start_conv * 100_000 + 1)  # session block ids (below _SYS_BASE)
    reqs: list[tuple[float, int, tuple[int, ...], int, int, int, str, int]] = []
    for i, (t0, k, srng) in enumerate(sessions):
        conv = start_conv + i
        sys_ids = [_SYS_BASE + k * 10_000 + j for j in range(sys_len[k])]
        turns = 1 + int(math.log(1.0 - srng.random()) / math.log(1.0 - 1.0 / cfg.mean_turns))
        full: list[int] = []  # the conversation's full blocks (stable ids)
        hist = 0  # conversation tokens so far
        t = t0
        key = ""
        for turn in range(turns):
            hist += srng.randint(*cfg.msg_tokens)
            while (len(full) + 1) * BLOCK_TOKENS <= hist:
                full.append(next(fresh))
            ids = tuple(sys_ids + full + ([next(fresh)] if hist % BLOCK_TOKENS else []))
            if turn == 0:
                key = f"{k}:{ids[len(sys_ids)]}"
            out = srng.randint(*cfg.out_tokens)
            reqs.append(
                (
                    t,
                    turn,
                    ids,
                    len(sys_ids) * BLOCK_TOKENS + hist,
                    out,
                    conv,
                    key,
                    len(sys_ids) * BLOCK_TOKENS,
                )
            )
            hist += out
            t += srng.expovariate(1.0 / cfg.think_s) + 5.0  # reading + typing
    reqs.sort(key=lambda r: (r[0], r[5], r[1]))
    return [
        Request(start_rid + n, t, ids, prompt, out, conv, key, turn, shared)
        for n, (t, turn, ids, prompt, out, conv, key, shared) in enumerate(reqs)
    ]


def pulse(
    cfg: SynthConfig,
    *,
    seed: int,
    at_s: float = 200.0,
    sessions: int = 200,
    within_s: float = 10.0,
    hot_blocks: int = 16,
) -> list[Request]:
    """The synthetic mix plus ``sessions`` sessions starting within ``within_s`` of
    ``at_s``, all on one hot system prompt of ``hot_blocks`` blocks (8k tokens)."""
    base = synthetic(cfg, seed=seed)
    rng = random.Random(f"{seed}:pulse")
    hot = cfg.system_prompts  # a prompt index the base mix never uses
    sys_len = [0] * cfg.system_prompts + [hot_blocks]
    burst = [
        (at_s + rng.random() * within_s, hot, random.Random(f"{seed}:pulse:{i}"))
        for i in range(sessions)
    ]
    start_conv = 1 + max((r.conv for r in base), default=0)
    extra = _turns(cfg, burst, sys_len, 0, start_conv)
    merged = sorted([*base, *extra], key=lambda r: (r.t, r.conv, r.turn))
    return [replace(r, rid=n) for n, r in enumerate(merged)]
