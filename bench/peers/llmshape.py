"""Pure: the shape of an LLM-rate phase of the whole-path benchmark, drawn once per round
and handed to every system's producer, so all of them publish the same tokens at the same
ticks.

A session alternates replies and gaps, as a chat does: a reply of ``L`` tokens decoded at
``rate`` tokens/s (``L`` from the mock engine's reply-length distribution,
:class:`devstack.mockengine.reply_length.ReplyLength`: log-normal, mean 300, 8 .. 2,000),
then the user's gap before the next turn (the routing simulator's think time,
``bench.routing.workloads``: exponential with mean :data:`THINK_S` plus
:data:`TYPING_S`). Each session starts at a uniformly drawn point of its first cycle, so a
round of a few seconds sees the stationary mix: some sessions mid-reply, most between
turns (a session at 60 tokens/s streams about an eighth of the time).

:func:`draw` gives each session's replies as ``(start_s, tokens)``; :func:`ticks` turns
them into the producers' schedule: for each ``tick_s`` tick, the sessions (by index) that
have a token due in it, once per token (a token due at ``k / rate`` after its reply's
start); a reply's first token is written ``-(index + 1)`` (:func:`session_of` reads
both), for a producer that starts a turn's coalescing there. :func:`mean_rate` is the
phase's expected tokens/s over all sessions.
"""

from __future__ import annotations

import math
import random

from devstack.mockengine.reply_length import ReplyLength

__all__ = [
    "REPLY", "THINK_S", "TYPING_S", "Replies", "draw", "even_ticks", "mean_rate", "session_of",
    "ticks",
]  # fmt: skip

REPLY = ReplyLength()  # the mock engine's defaults
THINK_S = 30.0  # bench.routing.workloads: expovariate(1 / think_s) + 5 s between turns
TYPING_S = 5.0

Replies = list[tuple[float, int]]  # one session's replies in a round: (start_s, tokens)


def _length(rng: random.Random) -> int:
    return REPLY.length([f"{rng.getrandbits(64):x}"])


def _gap(rng: random.Random) -> float:
    return rng.expovariate(1.0 / THINK_S) + TYPING_S


def draw(sessions: int, rate: float, seconds: float, seed: int) -> list[Replies]:
    """Each session's replies that start (or are under way) within ``seconds``: a reply
    under way at 0 starts at 0 with only its remaining tokens."""
    if sessions < 0 or rate <= 0 or seconds <= 0:
        raise ValueError("draw needs sessions >= 0, rate > 0 and seconds > 0")
    rng = random.Random(seed)
    out: list[Replies] = []
    for _ in range(sessions):
        length, gap = _length(rng), _gap(rng)
        cycle = length / rate + gap
        u = rng.uniform(0.0, cycle)  # where in its first cycle the round finds it
        replies: Replies = []
        if u < length / rate:
            left = length - int(u * rate)
            replies.append((0.0, left))
            t = left / rate + gap
        else:
            t = cycle - u
        while t < seconds:
            n = _length(rng)
            replies.append((t, n))
            t += n / rate + _gap(rng)
        out.append(replies)
    return out


def ticks(
    plan: list[Replies], rate: float, seconds: float, tick_s: float = 0.01
) -> list[list[int]]:
    """For each tick of ``seconds``, the session indices with a token due in it (a session
    repeated once per token due; a reply's first token as ``-(index + 1)``)."""
    n = round(seconds / tick_s)
    out: list[list[int]] = [[] for _ in range(n)]
    for i, replies in enumerate(plan):
        for start, tokens in replies:
            for k in range(tokens):
                t = math.floor((start + k / rate) / tick_s + 1e-9)
                if t >= n:
                    break
                out[t].append(i if k else -(i + 1))
    return out


def mean_rate(sessions: int, rate: float) -> float:
    """Expected tokens/s over ``sessions`` sessions in the stationary mix (the mean reply
    before clipping over the mean cycle)."""
    return sessions * REPLY.mean / (REPLY.mean / rate + THINK_S + TYPING_S)


def session_of(entry: int) -> int:
    """The session index of one entry of :func:`ticks`."""
    return entry if entry >= 0 else -entry - 1


def even_ticks(sessions: int, rate: float, seconds: float, tick_s: float = 0.01) -> list[list[int]]:
    """Today's steady pacing as a schedule: ``rate`` tokens/s per session, every tick the
    sessions ``i`` with ``i % groups == tick % groups`` (``groups = round(1 / (rate x
    tick_s))`` below one token per tick), as the paced publishers of the relay benchmarks
    do."""
    per_tick = rate * tick_s
    groups = max(1, round(1 / per_tick)) if per_tick < 1 else 1
    return [list(range(t % groups, sessions, groups)) for t in range(int(seconds / tick_s))]
