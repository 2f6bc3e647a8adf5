"""Cost-aware engine choice: least expected (queue wait + prefill of what is not cached).

What it is for: the worker picks an engine for a turn from what it already knows, with no
I/O: its load view (leases it holds, what other workers hold as of their last report),
the session meta it reads anyway (the engine of the session's previous turn, that turn's
prompt + reply length, when it ended) and its own recent decisions (how many prompt tokens
it sent to each engine since, which engines recently served a shared system prompt). For
each engine it estimates

    cost = (prefill tokens queued there + prompt tokens it probably does not hold)
           / that engine's prefill rate at its current batch

and takes the cheapest (the article's framing: stay where the cache is unless the queue
there costs more than recomputing elsewhere). Estimates:

- **held**: the previous turn's tokens on its engine, if fewer tokens than the engine's KV
  capacity have been sent there since (else the LRU has evicted them); otherwise the shared
  prefix (system prompt) on engines that served the same prefix key within that horizon.
- **queue**: the uncached prompt tokens of this worker's leases on the engine whose first
  token has not arrived, plus the other workers' leases there times this worker's mean.
- **rate**: chunked prefill: a step of ``chunk_tokens`` carries one token per running
  request and prefill in the rest; its time grows with the KV tokens the batch reads.
- **KV pressure**: the KV the engine's leases occupy beyond its capacity is added as
  recompute work (the engine would preempt and recompute that much). A shared prefix
  (system prompt) that several leases on one engine carry is counted once: the engine
  holds its blocks once (hundreds of turns on one 8k-token system prompt take 8k tokens of
  KV for it, not hundreds of times that).

**Precise** (``policy="precise"``, a :class:`~worker.routing.blockindex.BlockIndex` given):
for an engine the index follows (it publishes KV events), **held** is what the index says
it holds of the turn's blocks (``TurnInfo.blocks``: the prompt's block keys, by
:func:`worker.routing.tokens.block_keys`), or the shared prefix when turns on it are in
flight there (their blocks appear once their prefill is done); for any other engine, and
for a turn without block keys, the estimate above. Queue, rate and KV pressure are the same.

Pure: no I/O, no clock. Call order per turn:
``choice = m.choose(turn, others)``; ``m.admitted(lease_id, choice, turn)``; on the first
token ``m.first_token(lease_id)``; at the end ``m.finished(lease_id)`` (both idempotent).
``worker.routing.router.Router(policy="cost_aware")`` drives it with caps, draining and leases.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final

from worker.routing.blockindex import BlockIndex
from worker.routing.policy import RouteReason
from worker.routing.profile import EngineProfile, Profiles

__all__ = [
    "CHARS_PER_TOKEN",
    "REASONS",
    "Choice",
    "CostModel",
    "CostProfile",
    "TurnInfo",
    "turn_info",
]

# why an engine was chosen: the session's previous engine (or the shared prefix's) was
# the cheapest; a cheaper engine won over the one holding the cache; nothing was cached
REASONS: Final = ("preferred", "spilled_cost", "least_cost")


@dataclass(frozen=True, slots=True)
class CostProfile:
    """An engine's throughput figures (default: Llama-3.1-8B on one H100, as measured in
    bench/routing/engine_model.py and docs/ROUTING.md) and the weight of recomputed history."""

    kv_tokens: int = 400_000
    chunk_tokens: int = 2048
    step_base_s: float = 0.0065
    per_token_s: float = 0.000035
    per_kv_token_s: float = 0.000000056
    # the cost model's weight of a session's own prompt tokens an engine lacks (its
    # history, held elsewhere): computing them costs the turn their prefill and costs the
    # engine as much of its cache (its LRU evicts other sessions' blocks for them), which
    # the session's own engine would not spend; docs/ROUTING.md measures 1 against 2
    recompute_weight: float = 2.0


@dataclass(frozen=True, slots=True)
class TurnInfo:
    """What the worker knows about a turn before routing it."""

    prompt_tokens: int
    key: str = ""  # the routing key (stable across a session's turns)
    prev_engine: str = ""  # the engine of the session's previous turn ("" for a first turn)
    prev_tokens: int = 0  # that turn's prompt + reply tokens
    prev_mark: int = -1  # sent_tokens(prev_engine) when that turn was routed (-1: unknown)
    shared_key: str = ""  # the shared-prefix key (system prompt digest)
    shared_tokens: int = 0  # its length in tokens
    # precise: the keys of the prompt's full blocks (worker.routing.tokens.block_keys)
    blocks: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Choice:
    engine: str
    reason: RouteReason
    cost_s: float
    held_tokens: int
    wait_s: float = 0.0  # expected seconds to the first token


@dataclass(slots=True)
class _Lease:
    engine: str
    context: int
    pending: int  # uncached prompt tokens until the first token arrives
    shared_key: str = ""  # its shared prefix, counted once per engine in the KV footprint
    shared: int = 0  # that prefix's tokens
    # a slot engine whose slot the session's history was taken to have left: the share
    # of the prompt taken as held there, and the share its history would be
    held_frac: float = 0.0
    own_frac: float = 0.0


@dataclass
class CostModel:
    engines: Sequence[str]
    profile: CostProfile = field(default_factory=CostProfile)
    workers: int = 1  # live workers sharing the engines (scales this worker's token counts)
    index: BlockIndex | None = None  # precise: what the engines' KV events say they hold
    profiles: Profiles = field(default_factory=Profiles)  # each engine's shape and speed
    # slot engines: the conversations (routing key, shared key) each one served last,
    # newest last: the ones its slots probably still hold
    _slot_keys: dict[str, OrderedDict[str, str]] = field(default_factory=dict)
    _leases: dict[int, _Lease] = field(default_factory=dict)
    _sent: dict[str, int] = field(default_factory=dict)  # prompt tokens sent, cumulative
    _shared: dict[str, dict[str, int]] = field(default_factory=dict)  # key -> engine -> mark
    _pending: dict[str, int] = field(default_factory=dict)
    _context: dict[str, int] = field(default_factory=dict)
    _count: dict[str, int] = field(default_factory=dict)
    # KV footprint per engine: context outside shared prefixes, and each shared prefix
    # in flight there once (engine -> shared key -> [leases, tokens])
    _own_kv: dict[str, int] = field(default_factory=dict)
    _prefixes: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    _prefix_kv: dict[str, int] = field(default_factory=dict)
    # this worker's recent decisions: routing key -> (engine, mark, prompt tokens)
    _recent: OrderedDict[str, tuple[str, int, int]] = field(default_factory=OrderedDict)
    max_recent: int = 65_536
    # slot engines: turns that found a history their slots had given up (reported)
    _restored: dict[str, int] = field(default_factory=dict)

    def sent_tokens(self, engine: str) -> int:
        return self._sent.get(engine, 0)

    def _shape(self, engine: str) -> EngineProfile:
        return self.profiles.get(engine)

    def _fresh(self, engine: str, mark: int) -> bool:
        """Whether tokens sent to ``engine`` since ``mark`` (scaled to all workers) still
        fit in its KV capacity: the LRU has probably not evicted what was there."""
        kv = self._shape(engine).kv_tokens or self.profile.kv_tokens
        return (self.sent_tokens(engine) - mark) * self.workers < kv

    def _in_slot(self, engine: str, slots: int, key: str, shared_key: str) -> tuple[bool, bool]:
        """A slot engine: whether one of its ``slots`` most recent conversations is this
        one (its history is there), and whether one shares its system prompt."""
        recent = list(self._slot_keys.get(engine, {}).items())[-slots:]
        own = bool(key) and any(k == key for k, _ in recent)
        shared = bool(shared_key) and any(sk == shared_key for _, sk in recent)
        return own, shared

    def live(self, engine: str, others: Mapping[str, int]) -> int:
        return self._count.get(engine, 0) + max(0, others.get(engine, 0))

    def has_room(
        self, engine: str, others: Mapping[str, int], turn: TurnInfo | None = None
    ) -> bool:
        """A slot engine with a free slot, or a shared-pool engine (its cap bounds it).
        On the session's previous engine one of the other workers' leases may be that
        session's own previous turn, ended since their last report (the load view runs a
        quarter second behind, a follow-up can come sooner): it is not counted."""
        slots = self._shape(engine).slots
        if slots <= 0:
            return True
        live = self.live(engine, others)
        if turn is not None and engine == turn.prev_engine and others.get(engine, 0) > 0:
            live -= 1
        return live < slots

    def resolve(self, turn: TurnInfo) -> TurnInfo:
        """Fill what this worker's own decisions know: the previous engine of the key
        when the session meta has none, and its sent-token mark (unknown: assume fresh)."""
        seen = self._recent.get(turn.key) if turn.key else None
        if seen is not None and (not turn.prev_engine or turn.prev_engine == seen[0]):
            e, mark, tokens = seen
            return replace(
                turn, prev_engine=e, prev_mark=mark, prev_tokens=turn.prev_tokens or tokens
            )
        if turn.prev_engine and turn.prev_mark < 0:
            return replace(turn, prev_mark=self.sent_tokens(turn.prev_engine))
        return turn

    def _slot_only(self, engine: str) -> int:
        """A slot engine's slots when nothing behind them keeps a conversation its slot
        gave up (no prompt cache known), else 0: it holds like a shared pool."""
        shape = self._shape(engine)
        return shape.slots if shape.slots > 0 and not shape.kv_tokens else 0

    def held(self, engine: str, turn: TurnInfo) -> int:
        slots = self._slot_only(engine)
        if slots > 0:  # one conversation per slot: held while its slot was not reused
            own, shared = self._in_slot(engine, slots, turn.key, turn.shared_key)
            # a conversation this worker did not route there (another worker did: the
            # session meta names the engine) is taken as held
            seen = turn.key in self._slot_keys.get(engine, {})
            if engine == turn.prev_engine and turn.prev_tokens and (own or not seen):
                return min(turn.prev_tokens, turn.prompt_tokens)
            return min(turn.shared_tokens, turn.prompt_tokens) if shared else 0
        if engine == turn.prev_engine and turn.prev_tokens and self._fresh(engine, turn.prev_mark):
            return min(turn.prev_tokens, turn.prompt_tokens)
        marks = self._shared.get(turn.shared_key) if turn.shared_key else None
        if marks is not None and engine in marks and self._fresh(engine, marks[engine]):
            return min(turn.shared_tokens, turn.prompt_tokens)
        return 0

    def costs(
        self, turn: TurnInfo, others: Mapping[str, int]
    ) -> dict[str, tuple[float, int, float]]:
        """Per engine: (cost in seconds, tokens probably held, expected seconds to the
        first token). The cost is the expected time to the first token with the
        session's own tokens the engine lacks counted ``profile.recompute_weight`` times."""
        p = self.profile
        own_n = sum(self._count.values())
        mean_pending = sum(self._pending.values()) / own_n if own_n else 0.0
        mean_ctx = sum(self._context.values()) / own_n if own_n else float(turn.prompt_tokens)
        mean_kv = sum(self._own_kv.values()) / own_n if own_n else float(turn.prompt_tokens)
        shared = min(turn.shared_tokens, turn.prompt_tokens) if turn.shared_key else 0
        out: dict[str, tuple[float, int, float]] = {}
        turn = self.resolve(turn)
        index = self.index
        known = index.match(turn.blocks) if index is not None and turn.blocks else {}
        bs = index.tokens_per_block if index is not None else 0
        # an engine not measured yet is taken to be as fast as those that are (the same
        # model on alike hardware), never the default profile's accelerator: a measured
        # CPU engine against the default's rate drove every follow-up off its engine
        rates = sorted(r for x in self.engines if (r := self._shape(x).prefill_tok_per_s) > 0)
        peer_rate = rates[len(rates) // 2] if rates else 0.0
        for e in self.engines:
            n_other = max(0, others.get(e, 0))
            running = self._count.get(e, 0) + n_other
            ctx = self._context.get(e, 0) + n_other * mean_ctx
            queue = self._pending.get(e, 0) + n_other * mean_pending
            blocks = known.get(e)
            if blocks is None:
                held = self.held(e, turn)
            else:
                held = min(blocks * bs, turn.prompt_tokens)
                if shared > held and turn.shared_key in self._prefixes.get(e, {}):
                    held = shared
            # what it computes: the shared prefix it lacks, and the session's own tokens
            # it lacks (weighted: they evict as much of other sessions' cache)
            lacks = max(0, shared - held)
            session = turn.prompt_tokens - max(held, shared)
            wait = queue + turn.prompt_tokens - held
            work = queue + lacks + p.recompute_weight * session
            kv = self._own_kv.get(e, 0) + self._prefix_kv.get(e, 0) + n_other * mean_kv
            new_kv = turn.prompt_tokens
            if shared and turn.shared_key in self._prefixes.get(e, {}):
                new_kv -= shared  # its prefix is in flight there already
            overflow = kv + new_kv - p.kv_tokens
            if overflow > 0:
                work += overflow
                wait += overflow
            shape = self._shape(e)
            if shape.slots > 0 and running >= shape.slots:
                # every slot busy: the turn waits for one, about one turn's prefill and
                # reply of the conversation ahead (a slot engine computes its queue's
                # prompts, and its slots drop what they held for them)
                ahead = running - shape.slots + 1
                wait += ahead * (mean_ctx + _REPLY_TOKENS)
                work += ahead * (mean_ctx + _REPLY_TOKENS)
            if shape.prefill_tok_per_s > 0 or peer_rate > 0:
                # the engine's measured (or given) rate, else its measured peers'
                rate = shape.prefill_tok_per_s if shape.prefill_tok_per_s > 0 else peer_rate
            else:
                step = p.step_base_s + p.per_token_s * (p.chunk_tokens - 1)
                step += p.per_kv_token_s * ctx
                rate = max(1, p.chunk_tokens - running) / step
            out[e] = (work / rate, held, wait / rate)
        return out

    def choose(
        self,
        turn: TurnInfo,
        others: Mapping[str, int] | None = None,
        allowed: Iterable[str] | None = None,
        order: Sequence[str] = (),
    ) -> Choice:
        """The engine of least expected cost among ``allowed`` (default: all). A slot
        engine whose slots are all live is left out while another engine has room. Ties
        go to the fewest in flight, then to ``order`` (the session's ring walk: sessions
        spread over the engines, never all to the first one), then to ``engines``.
        ``turn`` is resolved (:meth:`resolve`) first."""
        names = list(self.engines if allowed is None else allowed)
        if not names:
            raise ValueError("no engine to choose from")
        view = others or {}
        turn = self.resolve(turn)
        roomy = [e for e in names if self.has_room(e, view, turn)]
        names = roomy or names
        costs = self.costs(turn, view)
        rank = {e: i for i, e in enumerate(order)}
        best = min(names, key=lambda e: (round(costs[e][0], 9), self.live(e, view),
                                         rank.get(e, len(rank))))  # fmt: skip
        cost, held, wait = costs[best]
        top = max(costs[e][1] for e in self.engines)
        if top == 0:
            reason = RouteReason.LEAST_COST
        elif held == top:
            reason = RouteReason.PREFERRED
        else:
            reason = RouteReason.SPILLED_COST
        return Choice(best, reason, cost, held, wait)

    def choose_queued(
        self,
        turn: TurnInfo,
        others: Mapping[str, int],
        under_cap: Sequence[str],
        past_cap: Sequence[str],
        slo_s: float,
        order: Sequence[str] = (),
    ) -> tuple[Choice, bool] | None:
        """The cheapest engine among ``under_cap`` and ``past_cap`` (engines at their cap
        with room left in their queue); one past its cap only when the expected time to
        the first token there is within ``slo_s``, else the cheapest under its cap. Returns
        the choice and whether it is past the cap; None when no engine is left."""
        if past_cap:
            choice = self.choose(turn, others, [*under_cap, *past_cap], order)
            if choice.engine not in past_cap:
                return choice, False
            if choice.wait_s <= slo_s:
                return choice, True
        if not under_cap:
            return None
        return self.choose(turn, others, under_cap, order), False

    # ---- what the worker tells it --------------------------------------------------------

    def admitted(self, lease_id: int, choice: Choice, turn: TurnInfo) -> int:
        """Record a routed turn; returns the engine's sent-token mark for the session meta
        (``TurnInfo.prev_mark`` of the session's next turn)."""
        e = choice.engine
        pending = max(0, turn.prompt_tokens - choice.held_tokens)
        shared = min(turn.shared_tokens, turn.prompt_tokens) if turn.shared_key else 0
        lease = _Lease(e, turn.prompt_tokens, pending, turn.shared_key, shared)
        own = min(turn.prev_tokens, turn.prompt_tokens)
        if self._slot_only(e) and e == turn.prev_engine and choice.held_tokens < own:
            lease.held_frac = choice.held_tokens / turn.prompt_tokens
            lease.own_frac = own / turn.prompt_tokens
        self._leases[lease_id] = lease
        self._own_kv[e] = self._own_kv.get(e, 0) + turn.prompt_tokens - shared
        if turn.shared_key:
            held_here = self._prefixes.setdefault(e, {})
            slot = held_here.get(turn.shared_key)
            if slot is None:
                held_here[turn.shared_key] = [1, shared]
                self._prefix_kv[e] = self._prefix_kv.get(e, 0) + shared
            else:
                slot[0] += 1
        self._pending[e] = self._pending.get(e, 0) + pending
        self._context[e] = self._context.get(e, 0) + turn.prompt_tokens
        self._count[e] = self._count.get(e, 0) + 1
        mark = self._sent.get(e, 0)
        self._sent[e] = mark + turn.prompt_tokens
        if turn.shared_key:
            self._shared.setdefault(turn.shared_key, {})[e] = mark
            if len(self._shared) > self.max_recent:
                self._shared.pop(next(iter(self._shared)))
        if self._shape(e).slots > 0:
            keys = self._slot_keys.setdefault(e, OrderedDict())
            keys.pop(turn.key, None)
            keys[turn.key] = turn.shared_key
            while len(keys) > max(64, 4 * self._shape(e).slots):
                keys.popitem(last=False)
        if turn.key:
            self._recent.pop(turn.key, None)
            self._recent[turn.key] = (e, mark, turn.prompt_tokens)
            if len(self._recent) > self.max_recent:
                self._recent.popitem(last=False)
        return mark

    def reported(self, lease_id: int, cached_tokens: int, prompt_tokens: int) -> None:
        """The engine's own report of a turn's prompt. A slot engine that reused most of a
        history its slots had given up (more than half of the way from what the model
        took as held to the whole history, in shares of the prompt: the engine's token
        counts and the model's character estimates differ in scale, not in shares), twice,
        keeps conversations behind its slots (llama-server's prompt cache, ``--cache-ram``,
        on by default): from then on it is costed as holding a session's history like a
        shared pool (:meth:`Profiles.learn_prompt_cache`), while its slots still bound
        how many run at once."""
        lease = self._leases.get(lease_id)
        if lease is None or not lease.own_frac or prompt_tokens <= 0:
            return
        gap = lease.own_frac - lease.held_frac
        if gap < _RESTORE_MIN_GAP:
            return
        if cached_tokens / prompt_tokens >= lease.held_frac + gap / 2:
            n = self._restored[lease.engine] = self._restored.get(lease.engine, 0) + 1
            if n >= _RESTORE_EVIDENCE:
                self.profiles.learn_prompt_cache(lease.engine)

    def first_token(self, lease_id: int) -> None:
        lease = self._leases.get(lease_id)
        if lease is not None and lease.pending:
            self._pending[lease.engine] -= lease.pending
            lease.pending = 0

    def finished(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return
        e = lease.engine
        self._pending[e] -= lease.pending
        self._context[e] -= lease.context
        self._count[e] -= 1
        self._own_kv[e] -= lease.context - lease.shared
        if lease.shared_key:
            held_here = self._prefixes[e]
            slot = held_here[lease.shared_key]
            slot[0] -= 1
            if slot[0] == 0:
                del held_here[lease.shared_key]
                self._prefix_kv[e] -= slot[1]

    def in_flight(self) -> dict[str, int]:
        return {e: self._count.get(e, 0) for e in self.engines}


_REPLY_TOKENS: Final = 128  # a slot engine's turn ahead: its reply, in prefill-token terms
# a slot engine keeps conversations behind its slots when this many turns reused a history
# the model took as gone, each one at least this share of the prompt beyond what it took
# as held (less is the system prompt's estimate being off, not a kept history)
_RESTORE_EVIDENCE: Final = 2
_RESTORE_MIN_GAP: Final = 0.1
CHARS_PER_TOKEN: Final = 4  # the worker has no tokenizer: ~4 characters a token (English)


def turn_info(
    key: str,
    system: str | None,
    history: Sequence[Mapping[str, str]],
    message: str,
    last_engine: str | None,
    blocks: Sequence[int] = (),
) -> TurnInfo:
    """A turn as the worker sees it before routing: prompt and history lengths estimated
    from their characters, the previous engine from the session meta, the system prompt
    (the part of the key before its first separator) as the shared prefix; ``blocks``:
    the prompt's block keys for the precise mode."""
    sys_chars = len(system or "")
    hist_chars = sum(len(m.get("content", "")) for m in history)
    return TurnInfo(
        prompt_tokens=max(1, (sys_chars + hist_chars + len(message)) // CHARS_PER_TOKEN),
        key=key,
        prev_engine=last_engine or "",
        prev_tokens=(sys_chars + hist_chars) // CHARS_PER_TOKEN if last_engine else 0,
        shared_key=key.split("\x1f", 1)[0] if system else "",
        shared_tokens=sys_chars // CHARS_PER_TOKEN,
        blocks=tuple(blocks),
    )
