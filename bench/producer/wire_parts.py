"""Bytes on the wire per delivered token, for a text-only reply and for a tool-heavy one.

What it answers: whether a reply's parts (reasoning, tool calls, data: docs/PROTOCOL.md,
"Parts") made text dearer on the wire, and what a reply's parts cost. The producer
(:mod:`relay.producer`) writes each reply into a memory store (the same frames it writes
to Redis), and the backlog is read back and encoded as the relay's own SSE wire encodes
it (:func:`relay.protocol.sse.event`, one event per frame: ``id:``, ``event:``,
``data:``). Figures:

* ``text`` — a text-only reply of ``tokens`` deltas (seeded words of 1-8 characters): the
  SSE bytes of the whole turn (``meta``, token frames, ``done``) per delta, at the
  worker's coalescing defaults (``coalesced``) and one frame per delta (``per_token``),
  and as a compacted join delivers the finished turn (``compacted``);
* ``tools`` — 10 tool calls of ``args_bytes`` of JSON arguments each, streamed in deltas
  of 1-40 characters, with reasoning, text, a result per call: the SSE bytes per byte of
  the parts' own text (arguments, reasoning, results), coalesced and compacted.
  Skipped (with the reason) on a tree whose producer has no parts.

``--baseline PATH``: the ``--json`` of a run on another tree (the one before parts):
each ``text`` figure's change, and exit 1 when one grew by more than 5 %.

Run: ``python -m bench.producer.wire_parts [--quick] [--json PATH] [--seed N]
[--baseline PATH]``.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.flags import Bench, Common, Outcome, flag
from relay.broker.memstore import MemoryStore
from relay.edge.core.compact import Compactor
from relay.edge.core.resume import Delivery
from relay.producer import CoalescePolicy, Producer, Turn
from relay.producer.coalesce import DEFAULT_POLICY
from relay.protocol.frame import decode, frame_gen
from relay.protocol.sse import event

__all__ = ["add_arguments", "main", "run_from_args"]

LIMIT = 0.05  # the text may not get dearer by more than this


@dataclass
class Flags(Common):
    seed: int = flag(1, "the reply's words and the deltas' sizes")
    tokens: int = flag(5000, "deltas of the text-only reply", quick=1000, least=1)
    args_bytes: int = flag(1024, "JSON bytes of each tool call's arguments", least=16)
    baseline: Path | None = flag(None, "the --json of a run to compare with", metavar="PATH")


def _sse(frames: list[bytes]) -> int:
    return sum(len(event(b, id=(f := decode(b)).offset, kind=f.kind)) for b in frames)


def _compacted(frames: list[bytes]) -> list[bytes]:
    c = Compactor()
    ds = []
    for b in frames:
        f = decode(b)
        ds.append(Delivery(f.offset, f.kind, b, f.ts, 0, frame_gen(f)))
    return [d.data for d in c.feed(ds) + c.flush()]


async def _reply(policy: CoalescePolicy, write: Any) -> list[bytes]:
    store = MemoryStore("bench", maxlen=1_000_000, max_bytes=1 << 30, ttl_s=600)
    p = Producer(store, keys="k" * 32, coalesce=policy)
    s = p.session("wire-parts")
    turn = await s.start_turn("a question", watch=False)
    await write(turn)
    await turn.done()
    page = await store.read_page(s.id, 0, 10_000_000, 0)
    return list(page.frames)


def _words(rng: random.Random, n: int) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return [" " + "".join(rng.choice(letters) for _ in range(rng.randint(1, 7))) for _ in range(n)]


async def _measure(f: Flags) -> dict[str, Any]:
    words = _words(random.Random(f.seed), f.tokens)

    async def text(turn: Any) -> None:
        for i, w in enumerate(words):
            turn.write(w)
            if i % 8 == 7:
                await asyncio.sleep(0)  # let the pump run, as between an engine's chunks

    out: dict[str, Any] = {"tokens": f.tokens}
    coalesced = await _reply(DEFAULT_POLICY, text)
    per_token = await _reply(CoalescePolicy(max_tokens=1), text)
    out["text"] = {
        "coalesced": round(_sse(coalesced) / f.tokens, 3),
        "per_token": round(_sse(per_token) / f.tokens, 3),
        "compacted": round(_sse(_compacted(per_token)) / f.tokens, 3),
        "frames_coalesced": len(coalesced),
    }
    if not hasattr(Turn, "tool_call_start"):
        out["tools"] = {"skipped": "this tree's producer writes no parts"}
        return out
    rng = random.Random(f.seed)
    own = 0

    async def tools(turn: Any) -> None:
        nonlocal own
        for i in range(10):
            thought = f"call {i}: which tool fits"
            turn.reasoning(thought)
            turn.write(f"Calling tool {i}. ")
            body = {"query": f"q{i}", "pad": ""}
            body["pad"] = "x" * max(f.args_bytes - len(json.dumps(body)), 0)
            args = json.dumps(body)
            turn.tool_call_start(f"call_{i}", "search")
            at = 0
            while at < len(args):
                n = rng.randint(1, 40)
                turn.tool_call_delta(f"call_{i}", args[at : at + n])
                at += n
                await asyncio.sleep(0)
            turn.tool_call_end(f"call_{i}")
            turn.tool_result(f"call_{i}", {"hits": i})
            own += len(thought) + len(args) + len(json.dumps({"hits": i}, separators=(",", ":")))

    frames = await _reply(DEFAULT_POLICY, tools)
    out["tools"] = {
        "calls": 10,
        "args_bytes": f.args_bytes,
        "parts_text_bytes": own,
        "sse_bytes": _sse(frames),
        "bytes_per_part_byte": round(_sse(frames) / own, 3),
        "compacted_bytes_per_part_byte": round(_sse(_compacted(frames)) / own, 3),
        "frames": len(frames),
    }
    return out


def report(r: dict[str, Any]) -> str:
    t = r["text"]
    lines = [
        "| text-only reply | SSE bytes per delivered token |",
        "|---|---|",
        f"| coalesced (the worker's defaults) | {t['coalesced']} |",
        f"| one frame per token | {t['per_token']} |",
        f"| compacted join | {t['compacted']} |",
    ]
    tools = r.get("tools", {})
    if "skipped" in tools:
        lines.append(f"\ntool-heavy reply: skipped ({tools['skipped']})")
    elif tools:
        lines.append(
            f"\ntool-heavy reply ({tools['calls']} calls, {tools['args_bytes']} B of arguments "
            f"each): {tools['bytes_per_part_byte']} SSE bytes per byte of the parts' text "
            f"({tools['compacted_bytes_per_part_byte']} compacted), {tools['frames']} frames"
        )
    if "baseline" in r:
        lines.append("")
        lines += [f"{k}: {v['before']} -> {v['after']} ({v['change_pct']:+.2f} %)"
                  for k, v in r["baseline"].items()]  # fmt: skip
    return "\n".join(lines)


def _run(f: Flags) -> Outcome:
    out = asyncio.run(_measure(f))
    code = 0
    if f.baseline is not None:
        before = json.loads(f.baseline.read_text())
        before = before.get("result", before)
        cmp: dict[str, Any] = {}
        for k in ("coalesced", "per_token", "compacted"):
            b, a = before["text"][k], out["text"][k]
            change = (a - b) / b * 100
            cmp[k] = {"before": b, "after": a, "change_pct": round(change, 2)}
            if change > LIMIT * 100:
                code = 1
        out["baseline"] = cmp
    return Outcome(out, report(out), code)


BENCH = Bench(Flags, _run, prog="python -m bench.producer.wire_parts", description=__doc__,
              quick_help="a shorter text-only reply", markdown=report)  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    sys.exit(main())
