"""The real engine's speed on this machine: llama.cpp's ``llama-server`` (SmolLM2-135M
Q4_1 on the CPU) reading prompts and writing replies, as the engine itself times them.

What it answers: how many prompt tokens a second the engine computes (prefill) and how
many reply tokens a second it writes (decode), one request at a time, with 1 and with 2
CPU threads: the figures a CPU engine's ``--engine-profile ID=prefill:R,decode:R`` and its
first-token timeout are sized from (docs/ROUTING.md). Each request sends a new prompt of
about ``--prompt-words`` words with ``cache_prompt`` off (nothing reused) and asks for
``--max-tokens`` tokens; the figures are the medians of the engine's own ``timings``
(``prompt_per_second``, ``predicted_per_second``) over ``--requests`` requests. The
machine's other load slows them: the JSON keeps the load average at the start and end.

And what a slot keeps: on a server with one slot, conversation A's turn, then B's (which
takes the slot), then A's next turn: the ``timings.cache_n`` of A's second turn (prompt
tokens reused) with the server's default host-memory prompt cache (``--cache-ram``) and
with ``--cache-ram 0``. Reused with the cache on, the slot's conversation was restored
from host memory: the server holds more conversations than it has slots.

Needs the built engine (``python -m devstack llama build``); without it, one line saying
why and exit 2. ``python -m bench.routing.llamarate [--quick] [--json PATH] [--seed N]``.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import tempfile
from dataclasses import dataclass
from typing import Any

import aiohttp

from bench.harness import Bench, Common, Outcome, flag
from devstack.llama.build import Built, find, missing_toolchain
from devstack.llama.serve import MODEL, llama_servers

__all__ = ["add_arguments", "main", "measure", "run_from_args"]

_WORDS = (  # noqa: SIM905 (readable as prose)
    "the harbour master counts the boats that come in with the tide and writes each "
    "name in a book kept by the window where the light falls on the water at dawn"
).split()


@dataclass
class Flags(Common):
    requests: int = flag(5, "requests per thread count (the median is reported)", quick=3,
                         least=1)  # fmt: skip
    prompt_words: int = flag(300, "words in each prompt", quick=120, least=1)
    max_tokens: int = flag(64, "reply tokens per request", quick=32, least=1)
    threads: str = flag("1,2", "CPU thread counts, comma-separated (llama-server -t)")
    seed: int = flag(7, "the prompts' words")


async def measure(built: Built, f: Flags, threads: int) -> dict[str, Any]:
    """One server with ``threads`` threads; the medians of its own timings."""
    rng = random.Random(f.seed)
    prefill: list[float] = []
    decode: list[float] = []
    prompt_n: list[int] = []
    with tempfile.TemporaryDirectory(prefix="llamarate-") as logs:
        async with (
            llama_servers(built, 1, logs, slots=1, ctx=4096, threads=threads) as (server,),
            aiohttp.ClientSession() as http,
        ):
            for i in range(f.requests + 1):  # the first one warms the server up
                text = " ".join(rng.choice(_WORDS) for _ in range(f.prompt_words))
                body = {"model": MODEL, "max_tokens": f.max_tokens, "cache_prompt": False,
                        "temperature": 0, "ignore_eos": True,
                        "messages": [{"role": "user", "content": f"{i}. {text}"}]}  # fmt: skip
                async with http.post(server.url + "/v1/chat/completions", json=body) as r:
                    t = (await r.json())["timings"]
                if i:
                    prefill.append(float(t["prompt_per_second"]))
                    decode.append(float(t["predicted_per_second"]))
                    prompt_n.append(int(t["prompt_n"]))
    return {
        "threads": threads,
        "prefill_tok_s": round(statistics.median(prefill), 1),
        "decode_tok_s": round(statistics.median(decode), 1),
        "prompt_tokens": int(statistics.median(prompt_n)),
        "prefill_all": [round(x, 1) for x in prefill],
        "decode_all": [round(x, 1) for x in decode],
    }


async def restore(built: Built, cache_ram_mib: int | None) -> dict[str, int]:
    """A, then B in the one slot, then A again: A's second turn's prompt and reuse."""
    rng = random.Random(3)

    def words(n: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    a = [{"role": "system", "content": "You answer about harbours. " + words(60)},
         {"role": "user", "content": words(30)}]  # fmt: skip
    b = [{"role": "system", "content": "You answer about ships. " + words(60)},
         {"role": "user", "content": words(30)}]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="llamarate-") as logs:
        async with (
            llama_servers(built, 1, logs, slots=1, ctx=2048, cache_ram_mib=cache_ram_mib) as (
                server,
            ),
            aiohttp.ClientSession() as http,
        ):

            async def chat(messages: list[dict[str, str]]) -> tuple[str, dict[str, Any]]:
                body = {"model": MODEL, "max_tokens": 8, "temperature": 0,
                        "messages": messages}  # fmt: skip
                async with http.post(server.url + "/v1/chat/completions", json=body) as r:
                    got = await r.json()
                return got["choices"][0]["message"]["content"], got["timings"]

            reply, _ = await chat(a)
            await chat(b)
            a += [{"role": "assistant", "content": reply}, {"role": "user", "content": words(30)}]
            _, t = await chat(a)
    return {"prompt_tokens": int(t["prompt_n"]) + int(t["cache_n"]), "cached": int(t["cache_n"])}


def table(res: dict[str, Any]) -> str:
    lines = [
        f"llama-server {res['version']} (SmolLM2-135M Q4_1, CPU), one request at a time, "
        f"{res['prompt_tokens']}-token prompts, {res['max_tokens']} reply tokens, "
        f"load average {res['load_before']:.1f} before and {res['load_after']:.1f} after",
        "",
        "| threads | prefill tokens/s | decode tokens/s |",
        "|---:|---:|---:|",
    ]
    for r in res["runs"]:
        lines.append(f"| {r['threads']} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.0f} |")
    on, off = res["restore"]["default"], res["restore"]["off"]
    lines += [
        "",
        f"one slot, conversation A, then B, then A's next turn: A reused {on['cached']} of "
        f"{on['prompt_tokens']} prompt tokens with the server's default prompt cache, "
        f"{off['cached']} of {off['prompt_tokens']} with --cache-ram 0",
    ]
    return "\n".join(lines)


def _run(f: Flags) -> Outcome:
    built = find()
    if built is None:
        why = missing_toolchain() or "llama-server is not built: python -m devstack llama build"
        return Outcome({"skipped": why}, f"skipped: {why}", 2)
    try:
        counts = [int(x) for x in f.threads.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        return Outcome({}, "--threads wants comma-separated whole numbers >= 1", 2)
    before = os.getloadavg()[0]
    runs = [asyncio.run(measure(built, f, n)) for n in counts]
    kept = {"default": asyncio.run(restore(built, None)), "off": asyncio.run(restore(built, 0))}
    res = {"version": built.version, "prompt_tokens": runs[0]["prompt_tokens"],
           "max_tokens": f.max_tokens, "load_before": round(before, 2),
           "load_after": round(os.getloadavg()[0], 2), "runs": runs,
           "restore": kept}  # fmt: skip
    return Outcome(res, table(res), 0)


BENCH = Bench(Flags, _run, prog="python -m bench.routing.llamarate", description=__doc__,
              quick_help="3 requests of 120 words, 32 reply tokens", markdown=table)  # fmt: skip
add_arguments, run_from_args, main = BENCH.add_arguments, BENCH.run_from_args, BENCH.main


if __name__ == "__main__":
    raise SystemExit(main())
