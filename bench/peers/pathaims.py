"""Pure: the whole-path benchmark's summaries and the ratios its aims name, from rounds.

:func:`summarize` turns one system's rounds of one phase into its medians (each
participant's CPU per delivered token is the median over the rounds; ``whole`` is the sum
of those medians, so the shares add up to it); :func:`aims` compares tokenrelay with each
peer in every phase:

- against Socket.IO: whole-path CPU per delivered token <= 0.8x, p99 <= 1x, keeping up
  at 10,000 tokens/s and more;
- against resumable-stream: <= 0.5x where a stream has more than one reader or a reader
  resumes, within 1.5x for one reader that never drops;
- the relay's CPU per delivered frame against the bare relay's (both over SSE): <= 1.3x;
- in the LLM-rate phases, against the peers that keep what they send: whole-path CPU per
  delivered token <= 1.0x Centrifugo's and <= 0.6x Socket.IO-with-the-streams-adapter's,
  p99 <= theirs plus tokenrelay's coalescing window; in the LLM storm p99 < 1 s with 0
  lost and 0 duplicated (counted against Redis); with 10 screens, p99 <= Socket.IO's.

A missed aim names the participant whose cost misses it: the one furthest over its part
of the target (ours minus aim x theirs, per participant).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from bench.peers.pathsystem import Phase, RoundFigures

__all__ = ["PARTICIPANTS", "aims", "summarize"]

PARTICIPANTS = ("producer", "redis", "server")


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def summarize(rounds: Sequence[RoundFigures]) -> dict[str, Any]:
    """Medians of one system's rounds of one phase (lost and duplicated summed)."""
    if not rounds:
        raise ValueError("no rounds to summarize")
    per = [r.us_per_delivered() for r in rounds]
    keys = [k for k in PARTICIPANTS if any(k in p for p in per)]
    us = {k: round(_median([p.get(k, 0.0) for p in per]), 2) for k in keys}
    whole = round(sum(us.values()), 2)
    pub = [max(r.published, 1) for r in rounds]
    pairs = list(zip(rounds, pub, strict=True))
    per_published = {
        k: round(_median([r.cpu_s.get(k, 0.0) * 1e6 / n for r, n in pairs]), 2) for k in keys
    }
    for role in ("masters", "replicas"):  # Redis's CPU by role, where the round has it
        got = [float(r.notes[f"redis_{role}_cpu_s"]) * 1e6 / n for r, n in pairs
               if f"redis_{role}_cpu_s" in r.notes]  # fmt: skip
        if got:
            per_published[f"redis_{role}"] = round(_median(got), 2)
    return {
        "us_per_token": {**us, "whole": whole},
        "redis_commands": _commands(rounds),
        "shares": {k: round(v / whole, 3) if whole else 0.0 for k, v in us.items()},
        "us_per_published": per_published,
        "p50_ms": _median([r.p50_ms for r in rounds]),
        "p99_ms": _median([r.p99_ms for r in rounds]),
        "behind_s": _median([r.behind_s for r in rounds]),
        "kept_up": all(r.kept_up() for r in rounds),
        "lost": sum(r.lost for r in rounds),
        "duplicated": sum(r.duplicated for r in rounds),
        "published": _median([r.published for r in rounds]),
        "delivered": _median([r.delivered for r in rounds]),
        "expected": _median([r.expected for r in rounds]),
        "rounds": [asdict(r) for r in rounds],
    }


def _commands(rounds: Sequence[RoundFigures], n: int = 8) -> list[dict[str, Any]]:
    """Per (role, command), the median over the rounds of its usec and calls per
    delivered token (0 in a round where it did not run); the ``n`` busiest."""
    names = sorted({(c["role"], c["command"]) for r in rounds for c in r.commands})
    rows = []
    for role, cmd in names:
        got = [next((c for c in r.commands if (c["role"], c["command"]) == (role, cmd)), None)
               for r in rounds]  # fmt: skip
        rows.append({"role": role, "command": cmd,
                     "us_per_token": round(_median([c["us_per_token"] if c else 0.0
                                                    for c in got]), 3),
                     "calls_per_token": round(_median([c["calls_per_token"] if c else 0.0
                                                       for c in got]), 4)})  # fmt: skip
    rows.sort(key=lambda r: -float(r["us_per_token"]))
    return rows[:n]


def _miss(ours: Mapping[str, float], theirs: Mapping[str, float], aim: float) -> str:
    """The participant furthest over its part of the target."""
    excess = {p: ours.get(p, 0.0) - aim * theirs.get(p, 0.0) for p in PARTICIPANTS}
    worst = max(excess, key=lambda p: excess[p])
    return f"{worst} (+{excess[worst]:.1f} µs/token over {aim:g}x its part)"


def _row(
    phase: str, what: str, ours: float, theirs: float, aim: float, **more: Any
) -> dict[str, Any]:
    ratio = round(ours / theirs, 3) if theirs else None
    met = ratio is not None and ratio <= aim
    return {"phase": phase, "aim": what, "ours": ours, "theirs": theirs, "ratio": ratio,
            "target": aim, "met": met, "missed_by": "" if met else more.get("missed_by", ""),
            **{k: v for k, v in more.items() if k != "missed_by"}}  # fmt: skip


# the LLM-rate phases' peers: name, whole-path CPU target
LLM_PEERS = (("centrifugo", 1.0), ("socketio-streams", 0.6))


def _llm_aims(
    name: str, phase: Phase, got: Mapping[str, Mapping[str, Any]], missing: Mapping[str, str],
    window_ms: float,
) -> list[dict[str, Any]]:  # fmt: skip
    tr = got["tokenrelay"]
    ours = tr["us_per_token"]
    out: list[dict[str, Any]] = []
    for peer, target in LLM_PEERS:
        theirs = got.get(peer)
        if theirs is None:
            why = f"not in this run: {missing.get(peer, 'not run in this phase')}"
            out.append({"phase": name, "aim": f"whole CPU/token vs {peer}", "ours": ours["whole"],
                        "theirs": None, "ratio": None, "target": target, "met": None,
                        "missed_by": why})  # fmt: skip
            continue
        out.append(_row(name, f"whole CPU/token vs {peer}", ours["whole"],
                        theirs["us_per_token"]["whole"], target,
                        missed_by=_miss(ours, theirs["us_per_token"], target)))  # fmt: skip
        p99 = theirs["p99_ms"]
        ok = tr["p99_ms"] <= p99 + window_ms
        out.append({"phase": name, "aim": f"p99 vs {peer} + {window_ms:g} ms window",
                    "ours": tr["p99_ms"], "theirs": p99,
                    "ratio": round(tr["p99_ms"] / p99, 3) if p99 else None,
                    "target": f"<= theirs + {window_ms:g} ms", "met": ok,
                    "missed_by": "" if ok else "latency"})  # fmt: skip
    if phase.storm:
        ok = tr["p99_ms"] < 1000 and tr["lost"] == 0 and tr["duplicated"] == 0
        out.append({"phase": name, "aim": "storm: p99 < 1 s, 0 lost, 0 dup",
                    "ours": f"{tr['p99_ms']} ms, {tr['lost']} lost, {tr['duplicated']} dup",
                    "theirs": None, "ratio": None, "target": True, "met": ok,
                    "missed_by": "" if ok else "see the figures"})  # fmt: skip
    sio = got.get("socketio")
    if phase.viewers > 1 and sio is not None:
        out.append(_row(name, "10-screen p99 vs socketio", tr["p99_ms"], sio["p99_ms"], 1.0,
                        missed_by="latency"))  # fmt: skip
    return out


def aims(
    phases: Mapping[str, Phase], results: Mapping[str, Mapping[str, Mapping[str, Any]]],
    missing: Mapping[str, str], window_ms: float = 50.0,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every aim's row in every phase where both sides ran; a row per absent peer.
    ``window_ms``: tokenrelay's coalescing window in the LLM-rate phases."""
    out: list[dict[str, Any]] = []
    for name, phase in phases.items():
        got = results.get(name, {})
        tr = got.get("tokenrelay")
        if tr is None:
            continue
        ours = tr["us_per_token"]
        if phase.llm:
            out += _llm_aims(name, phase, got, missing, window_ms)
            continue
        sio = got.get("socketio")
        if sio is not None:
            theirs = sio["us_per_token"]
            out.append(_row(name, "whole CPU/token vs socketio", ours["whole"], theirs["whole"],
                            0.8, missed_by=_miss(ours, theirs, 0.8)))  # fmt: skip
            late = "latency"
            if sio["lost"]:  # its p99 is over what reached a reader; ours over every token
                late = (
                    f"latency (Socket.IO's p99 leaves out the {sio['lost']} tokens it "
                    "lost; tokenrelay's includes the ones replayed after the reconnect)"
                )
            out.append(_row(name, "p99 vs socketio", tr["p99_ms"], sio["p99_ms"], 1.0,
                            missed_by=late))  # fmt: skip
            if phase.tokens_per_s >= 10_000:
                ok = bool(tr["kept_up"])
                why = "" if ok else f"behind {tr['behind_s']} s, lost {tr['lost']}"
                out.append({"phase": name, "aim": "keeps up", "ours": ok,
                            "theirs": sio["kept_up"], "ratio": None, "target": True, "met": ok,
                            "missed_by": why})  # fmt: skip
        many = phase.viewers > 1 or phase.kind == "resume_storm"
        target = 0.5 if many else 1.5
        rs = got.get("resumable-stream")
        if rs is not None:
            theirs = rs["us_per_token"]
            miss = _miss(ours, theirs, target)
            out.append(_row(name, "whole CPU/token vs resumable-stream", ours["whole"],
                            theirs["whole"], target, missed_by=miss))  # fmt: skip
        elif "resumable-stream" in missing:
            why = f"not in this run: {missing['resumable-stream']}"
            out.append({"phase": name, "aim": "whole CPU/token vs resumable-stream",
                        "ours": ours["whole"], "theirs": None, "ratio": None, "target": target,
                        "met": None, "missed_by": why})  # fmt: skip
        sse, bare = got.get("tokenrelay-sse"), got.get("bare")
        if sse is not None and bare is not None:
            a, b = sse["us_per_token"]["server"], bare["us_per_token"]["server"]
            out.append(_row(name, "relay CPU/frame vs bare relay", a, b, 1.3,
                            missed_by="server (the relay process)"))  # fmt: skip
    return out
