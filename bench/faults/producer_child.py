"""A producer of your own, in Python, for the nemesis (:mod:`bench.faults.nemesis`): the
producer API (:mod:`relay.producer`) writing turn after turn into its sessions until
``duration_s`` has passed, ``rate`` deltas per second, replies of ``reply_min`` ..
``reply_max`` deltas. The Python twin of ``bench/producer/soak_producer.mjs`` (same spec,
same one line of JSON at the end: turns, deltas, the errors it met). Killed mid-turn by
the nemesis and started again, it goes on where the session stands: its killed turn is
the relays' and the next producer's to end.

Run: ``python -m bench.faults.producer_child SPEC.json``.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from typing import Any

from relay.producer import Producer, ProducerError

__all__ = ["main"]

WORDS = ("relay ", "token ", "stream ", "wörld ", "🙂 ", "中文 ", '"q" ', "a\\b ", "line\n")


async def _session(p: Producer, sid: str, spec: dict[str, Any], stats: dict[str, Any]) -> None:
    rng = random.Random(f"{spec.get('seed', 1)}:{sid}")
    until = time.monotonic() + float(spec["duration_s"])
    session = p.session(sid)
    while time.monotonic() < until:
        n = rng.randint(int(spec["reply_min"]), int(spec["reply_max"]))
        try:
            turn = await session.start_turn(f"nemesis turn {stats['turns']}")
            t0 = time.monotonic()
            for k in range(n):
                turn.write(rng.choice(WORDS))
                delay = t0 + (k + 1) / float(spec["rate"]) - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            await turn.done()
            stats["turns"] += 1
            stats["deltas"] += n
        except ProducerError as exc:  # a fault in its way: say it and go on
            stats["errors"].append(f"{sid}: {type(exc).__name__}: {exc}")
            await asyncio.sleep(0.1)


async def _main(spec: dict[str, Any]) -> dict[str, Any]:
    stats: dict[str, Any] = {"turns": 0, "deltas": 0, "errors": []}
    p = await Producer.connect(spec["url"], producer_id=spec.get("producer_id", "nemesis-py"))
    try:
        await asyncio.gather(*(_session(p, sid, spec, stats) for sid in spec["sessions"]))
    finally:
        await p.aclose()
    return {**stats, "errors": stats["errors"][:10], "error_count": len(stats["errors"])}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    with open(args[0], encoding="utf-8") as f:
        spec = json.load(f)
    print(json.dumps(asyncio.run(_main(spec))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
