"""Engine profiles: each engine's cache shape and speed, from flags and from its reports.

Engines differ in what the router and the turn must know of them:

- **cache shape**: a shared token pool (vLLM, SGLang: any number of conversations share
  ``kv_tokens`` of KV cache, the least recently used blocks go first), or ``slots``
  (llama.cpp's ``llama-server -np N``, Ollama: N conversations, each in its own slot; a
  new conversation on a busy engine waits for a slot, and one on an idle slot drops the
  conversation that slot held);
- **context**: the tokens one request may hold (prompt + reply): the history sent is
  trimmed to it (:mod:`worker.chat.trim`);
- **speed**: prefill and decode rates in tokens/s (a CPU engine reads prompts at tens of
  tokens a second, a GPU at thousands); the first-token timeout of a slow engine.

A profile comes from ``--engine-profile ID=slots:2,ctx:2048,prefill:90,decode:50,
first_token_timeout:180`` (``*=...`` for every engine; an engine's own entry over it) and
from what the engine reports at run time (:meth:`Profiles.learn_props`: llama-server's
``/props`` ``total_slots`` and ``n_ctx``; :meth:`Profiles.learn_turn`: each turn's
prefill and decode timings, as moving averages; :meth:`Profiles.learn_prompt_cache`: a
slot engine that reused more of a conversation than its slots could have held has a
prompt cache behind them, which ``/props`` does not say). A flag's value wins over a learned one;
0 means "not known" everywhere. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Final

__all__ = [
    "LEARNED_PROMPT_CACHE",
    "PROFILE_KEYS",
    "EngineProfile",
    "Profiles",
    "parse_profile_arg",
]

_ALPHA: Final = 0.2  # weight of a new turn's rate in the moving average
_MIN_TOKENS: Final = 8  # a rate from fewer tokens than this is noise (a cache hit's tail)
# a slot engine seen to restore conversations its slots gave up: the tokens its prompt
# cache is taken to hold (a guess, on the low side: llama-server's default 8 GiB holds
# millions of a small model's tokens, tens of thousands of a 70B's; --engine-profile
# ID=kv:N says it)
LEARNED_PROMPT_CACHE: Final = 100_000


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """What is known of one engine (0: not known; the router's defaults then)."""

    slots: int = 0  # N: one conversation per slot (llama.cpp, Ollama); 0: a shared pool
    # the shared pool's size in tokens; on a slot engine, the prompt cache behind its
    # slots (llama-server's --cache-ram: a conversation a slot gave up is kept there and
    # restored when it comes back), 0: none, a slot holds the conversation it served last
    kv_tokens: int = 0
    context_tokens: int = 0  # one request's context (prompt + reply)
    prefill_tok_per_s: float = 0.0
    decode_tok_per_s: float = 0.0
    first_token_timeout_s: float = 0.0

    def over(self, base: EngineProfile) -> EngineProfile:
        """This profile's known fields over ``base``'s."""
        return replace(
            base, **{f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name)}
        )


# the flag's keys -> the profile's fields
PROFILE_KEYS: Final = {
    "slots": "slots",
    "kv": "kv_tokens",
    "ctx": "context_tokens",
    "prefill": "prefill_tok_per_s",
    "decode": "decode_tok_per_s",
    "first_token_timeout": "first_token_timeout_s",
}
_INTS: Final = {"slots", "kv_tokens", "context_tokens"}


def parse_profile_arg(arg: str) -> tuple[str, EngineProfile]:
    """``ID=key:value,...`` (``*`` for every engine) -> (id, profile); ValueError with a
    one-line reason for anything else."""
    eid, sep, rest = arg.partition("=")
    eid = eid.strip()
    if not sep or not eid or not rest.strip():
        raise ValueError(f"--engine-profile wants ID=key:value,..., got {arg!r}")
    values: dict[str, float | int] = {}
    for item in rest.split(","):
        key, colon, raw = item.strip().partition(":")
        name = PROFILE_KEYS.get(key.strip())
        if name is None or not colon:
            keys = ", ".join(PROFILE_KEYS)
            raise ValueError(f"--engine-profile {eid}: unknown entry {item!r} (keys: {keys})")
        try:
            num: float | int = int(raw) if name in _INTS else float(raw)
        except ValueError:
            raise ValueError(f"--engine-profile {eid}: {key} wants a number, got {raw!r}") from None
        if not num > 0 or num != num or num == float("inf"):
            raise ValueError(f"--engine-profile {eid}: {key} must be > 0, got {raw!r}")
        values[name] = num
    return eid, EngineProfile(**values)  # type: ignore[arg-type]


class Profiles:
    """Every engine's profile: the flags' over what the engines reported."""

    def __init__(self, flags: Mapping[str, EngineProfile] | None = None) -> None:
        flags = dict(flags or {})
        self._all = flags.pop("*", EngineProfile())
        self._flags = flags
        self._learned: dict[str, EngineProfile] = {}

    def get(self, engine_id: str) -> EngineProfile:
        learned = self._learned.get(engine_id, EngineProfile())
        own = self._flags.get(engine_id, EngineProfile())
        return own.over(self._all).over(learned)

    def learned(self, engine_id: str) -> EngineProfile:
        return self._learned.get(engine_id, EngineProfile())

    def learn_props(self, engine_id: str, *, slots: int = 0, context_tokens: int = 0) -> None:
        """What the engine says of itself (llama-server's ``/props``: ``total_slots``, the
        slots' ``n_ctx``)."""
        cur = self._learned.get(engine_id, EngineProfile())
        self._learned[engine_id] = EngineProfile(
            slots=max(0, slots), context_tokens=max(0, context_tokens)
        ).over(cur)

    def learn_prompt_cache(self, engine_id: str, tokens: int = LEARNED_PROMPT_CACHE) -> None:
        """A slot engine reused a conversation its slots had given up: it keeps them in
        a prompt cache (llama-server's --cache-ram, on by default), taken to hold
        ``tokens`` unless a flag or an earlier report said how much."""
        cur = self._learned.get(engine_id, EngineProfile())
        if not cur.kv_tokens:
            self._learned[engine_id] = replace(cur, kv_tokens=tokens)

    def learn_turn(
        self,
        engine_id: str,
        *,
        computed_tokens: int | None,
        prefill_s: float | None,
        completion_tokens: int | None,
        decode_s: float | None,
    ) -> None:
        """One turn's timings as the engine reported them: moving averages of its rates."""
        cur = self._learned.get(engine_id, EngineProfile())
        prefill, decode = cur.prefill_tok_per_s, cur.decode_tok_per_s
        if computed_tokens and computed_tokens >= _MIN_TOKENS and prefill_s and prefill_s > 0:
            prefill = _ewma(prefill, computed_tokens / prefill_s)
        if completion_tokens and completion_tokens >= _MIN_TOKENS and decode_s and decode_s > 0:
            decode = _ewma(decode, completion_tokens / decode_s)
        self._learned[engine_id] = replace(cur, prefill_tok_per_s=prefill, decode_tok_per_s=decode)

    def forget(self, engine_id: str) -> None:
        self._learned.pop(engine_id, None)


def _ewma(old: float, new: float) -> float:
    return new if old <= 0 else old + _ALPHA * (new - old)
