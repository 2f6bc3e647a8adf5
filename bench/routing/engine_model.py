"""A continuous-batching inference engine, as a pure step model (no clock, no I/O).

What it is for: the routing simulator (``bench/routing/sim.py``) needs engines whose
latency responds to load the way vLLM's does, or every routing comparison is decided by
the model's blind spots. This module is one engine:

- **Steps.** The engine runs one forward pass (a *step*) at a time. A step carries one
  token for every running sequence that is decoding, plus prefill chunks, up to a token
  budget (``chunk_tokens``, vLLM's ``--max-num-batched-tokens``) and ``max_seqs``
  running sequences. Decodes are scheduled first, then the unfinished prefills of running
  sequences, then waiting sequences in arrival order (chunked prefill: a long prompt is
  spread over several steps, sharing each with the decodes, which therefore slow down).
- **Step time** = ``step_base_s`` + ``per_token_s`` x tokens in the step +
  ``per_kv_token_s`` x KV tokens the step's attention reads (each decode reads its whole
  context; a prefill chunk reads its prefix and itself).
- **KV cache in blocks** of ``block_tokens``. A sequence holds the blocks of its prompt
  (named by the workload's block ids, so equal ids are the same cached prefix) and
  private blocks for the tokens it generates. Named blocks are shared by every running
  sequence that references them; a named block nobody references stays cached in an LRU
  (the prefix cache) until a new allocation needs its space. A waiting sequence's prompt
  reuses the leading named blocks the engine holds *computed* (their KV written by a
  prefill that got past them, running or cached) and computes the rest; it is admitted
  only when its blocks fit (evicting unreferenced blocks first). A block allocated but not
  yet computed is no hit for anybody, and is dropped, not cached, when its last
  reference goes (a prefill preempted half-way keeps only the part it computed).
- **Preemption.** When a decode needs a new block and none is free or evictable, the
  newest running sequence is preempted: its blocks are released (the computed named ones
  go to the prefix cache) and it returns to the head of the waiting queue, to recompute
  its prompt and the tokens it already generated (vLLM's default, recompute) before it
  continues.
- **Clock.** Time passes only in steps. A step starts when the engine is idle and a
  request arrives (at the arrival, not later) or when the previous step ends and work is
  left (at that end); a request that arrives during a step joins at the next step
  boundary (vLLM schedules between forward passes). An idle engine does not tick: it
  waits for the next arrival. ``Engine.start`` is that rule, ``replay`` runs one engine
  by it.

KV events (``kv_events`` a list): what vLLM would publish, appended as they happen: a
block *stored* when a prefill gets past it (its parent: the block before it in the
prompt), *removed* when the LRU evicts it (a block freed before anybody computed it was
never stored). ``bench/routing/core.py`` feeds them to the ``precise`` policy's index.

Call order: ``e = Engine(params)``; ``e.submit(seq)`` when a request arrives, then
``t = e.start(now)``; when a step ends (at ``t``), ``e.end(t)``, which returns the
sequences that produced their first token and those that finished, then
``e.start(t)`` again. (``e.begin()`` schedules a step and returns its duration, for a
caller that keeps its own clock.) Every sequence records its first-token time, token gaps
and prefix hits. Deterministic; nothing here reads a clock or a random source.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

__all__ = ["H100_LLAMA8B", "Engine", "EngineParams", "Seq", "replay"]


@dataclass(frozen=True, slots=True)
class EngineParams:
    """One GPU serving one model. Defaults: Llama-3.1-8B (bf16) on one H100-80GB; the
    sources of each figure are in docs/ROUTING.md ("The engine model")."""

    kv_tokens: int = 400_000  # KV capacity after weights and activations
    block_tokens: int = 512  # KV block size (the workload's prefix-block size)
    chunk_tokens: int = 2048  # token budget of one step
    max_seqs: int = 256  # running sequences at most
    step_base_s: float = 0.0065  # a step that carries one token (weights read once)
    per_token_s: float = 0.000035  # each further token in the step (compute)
    per_kv_token_s: float = 0.000000056  # each KV token the attention reads (128 KiB)

    @property
    def blocks(self) -> int:
        return self.kv_tokens // self.block_tokens


H100_LLAMA8B: Final = EngineParams()


@dataclass(eq=False, slots=True)
class Seq:
    """One request on one engine. ``ids``: the prompt's block ids (one per
    ``block_tokens`` of prompt, the last one possibly partial)."""

    rid: int
    ids: tuple[int, ...]
    prompt: int  # prompt tokens
    out: int  # tokens to generate (>= 1)
    arrival: float  # when the request reached the engine (for TTFT, set by the caller)
    generated: int = 0
    computed: int = 0  # context tokens whose KV is computed (prefill progress)
    named: int = 0  # leading prompt blocks referenced (0 while waiting)
    marked: int = 0  # leading prompt blocks recorded as computed (Engine.ready)
    private: int = 0  # blocks held for generated tokens
    cached_tokens: int = 0  # prompt tokens found cached at the first admission
    scheduled: float = -1.0  # the first step boundary at or after its arrival
    first_token: float = -1.0
    last_token: float = -1.0
    done: float = -1.0
    gap_max: float = 0.0
    preempted: int = 0
    admitted: bool = False
    decoding: bool = False  # prefill done: one token per step; computed == context - 1

    @property
    def context(self) -> int:
        return self.prompt + self.generated


@dataclass(slots=True)
class _Step:
    decodes: list[Seq]
    chunks: list[tuple[Seq, int]]
    duration: float


@dataclass
class Engine:
    """One engine's scheduler and KV cache (see the module docstring)."""

    params: EngineParams
    waiting: deque[Seq] = field(default_factory=deque)
    arrived: list[Seq] = field(default_factory=list)  # submitted since the last boundary
    running: list[Seq] = field(default_factory=list)  # admission order: newest last
    ref: dict[int, int] = field(default_factory=dict)  # named block -> references
    ready: set[int] = field(default_factory=set)  # referenced named blocks already computed
    lru: OrderedDict[int, None] = field(default_factory=OrderedDict)  # cached, unreferenced
    private: int = 0
    step: _Step | None = None
    # counters
    steps: int = 0
    busy_s: float = 0.0
    longest_step_s: float = 0.0
    preemptions: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0  # prefill tokens computed, recomputation included
    decoded_tokens: int = 0
    gaps: dict[float, int] = field(default_factory=dict)  # token gap (ms, 0.1) -> count
    # KV events, as vLLM publishes them (None: not recorded): ("stored", blocks, parent)
    # when a run of named blocks becomes computed, ("removed", blocks, None) on eviction
    kv_events: list[tuple[str, list[int], int | None]] | None = None

    # ---- what a router could be told -------------------------------------------------

    def load(self) -> int:
        """Requests on the engine: running + waiting."""
        return len(self.running) + len(self.waiting)

    def free_blocks(self) -> int:
        return self.params.blocks - len(self.ref) - self.private

    def holds(self, ids: tuple[int, ...]) -> int:
        """Leading blocks of ``ids`` present and computed (referenced or cached). Read-only."""
        n = 0
        for b in ids:
            if b in self.ready or b in self.lru:
                n += 1
            else:
                break
        return n

    def busy(self) -> bool:
        return self.step is not None

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- requests ----------------------------------------------------------------------

    def fits(self, prompt: int, out: int, nblocks: int) -> bool:
        """Whether one request could ever run here (its whole context in the KV cache)."""
        bt = self.params.block_tokens
        return max(nblocks, -(-(prompt + out) // bt)) + 1 <= self.params.blocks

    def submit(self, seq: Seq) -> None:
        if seq.out < 1 or seq.prompt < 1 or not seq.ids:
            raise ValueError("a request needs a prompt, block ids and at least one output token")
        if not self.fits(seq.prompt, seq.out, len(seq.ids)):
            raise ValueError(f"request {seq.rid} needs more KV blocks than the engine has")
        self.waiting.append(seq)
        self.arrived.append(seq)

    # ---- blocks ------------------------------------------------------------------------

    def _evict(self, need: int) -> bool:
        """Make ``need`` blocks free, evicting least recently used cached blocks."""
        short = need - (self.free_blocks() - len(self.lru))
        if short > len(self.lru):
            return False
        gone = [self.lru.popitem(last=False)[0] for _ in range(max(0, short))]
        if gone and self.kv_events is not None:
            self.kv_events.append(("removed", gone, None))
        return True

    def _release(self, s: Seq) -> None:
        """Give back every block of ``s``; its computed named blocks stay cached, tail
        first in the eviction order (the prefix is the most recently used); a block
        nobody computed is freed."""
        for b in reversed(s.ids[: s.named]):
            r = self.ref[b] - 1
            if r:
                self.ref[b] = r
            else:
                del self.ref[b]
                if b in self.ready:
                    self.ready.discard(b)
                    self.lru[b] = None
        self.private -= s.private
        s.named = s.private = s.marked = 0

    def _mark(self, s: Seq) -> None:
        """Record the prompt blocks ``s``'s prefill has got past as computed (the last,
        partial one once the whole prompt is)."""
        n = len(s.ids) if s.computed >= s.prompt else s.computed // self.params.block_tokens
        if n > s.marked:
            if self.kv_events is not None:
                self._stored(s.ids, s.marked, n)
            self.ready.update(s.ids[s.marked : n])
            s.marked = n

    def _stored(self, ids: tuple[int, ...], lo: int, hi: int) -> None:
        """The KV events of blocks ``ids[lo:hi]`` becoming computed: one per run of
        blocks not computed before (another sequence may have computed some)."""
        assert self.kv_events is not None
        run: list[int] = []
        for i in range(lo, hi + 1):
            if i < hi and ids[i] not in self.ready:
                run.append(ids[i])
                continue
            if run:
                first = i - len(run)
                self.kv_events.append(("stored", run, ids[first - 1] if first else None))
                run = []

    def _private_needed(self, s: Seq, context: int) -> int:
        bt = self.params.block_tokens
        return max(0, -(-context // bt) - len(s.ids)) - s.private

    def _admit(self, s: Seq) -> bool:
        """Reference the prompt's cached leading blocks and allocate the rest (and blocks
        for tokens generated before a preemption). False when they do not fit."""
        hit = self.holds(s.ids)
        extra = self._private_needed(s, s.context)
        in_lru = sum(1 for b in s.ids if b in self.lru)
        fresh = sum(1 for b in s.ids if b not in self.lru and b not in self.ref)
        # blocks this prompt takes out of the LRU are not evictable for it
        if self.free_blocks() - in_lru < fresh + extra:
            return False
        new: list[int] = []
        for b in s.ids:
            if b in self.lru:
                del self.lru[b]
                self.ref[b] = 1
                self.ready.add(b)
            elif b in self.ref:
                self.ref[b] += 1
            else:
                new.append(b)
        ok = self._evict(len(new) + extra)
        assert ok, "admission check and eviction disagree"
        for b in new:
            self.ref[b] = self.ref.get(b, 0) + 1
        s.named = len(s.ids)
        s.private += extra
        self.private += extra
        bt = self.params.block_tokens
        s.computed = min(hit * bt, s.context - 1)  # at least one token is computed
        s.marked = hit
        if not s.admitted:
            s.admitted = True
            s.cached_tokens = s.computed
            self.prompt_tokens += s.prompt
            self.hit_tokens += s.computed
        return True

    def _preempt_newest(self) -> Seq:
        s = self.running.pop()
        self._release(s)
        s.computed = 0
        s.decoding = False
        s.preempted += 1
        self.preemptions += 1
        self.waiting.appendleft(s)
        return s

    # ---- steps -------------------------------------------------------------------------

    def start(self, now: float) -> float | None:
        """Start the next step at ``now`` if the engine is idle and has work to schedule;
        returns when it ends (call :meth:`end` then), or None when no step starts (a step
        is running: arrivals join at its end; or nothing to run: no time passes)."""
        if self.step is not None:
            return None
        for s in self.arrived:  # the scheduler sees them now: their wait for a boundary ends
            s.scheduled = now
        self.arrived.clear()
        dur = self.begin()
        return now + dur if dur > 0 else None

    def begin(self) -> float:
        """Schedule the next step; returns its duration (0.0 when there is nothing to
        run: the engine stays idle). Call only when not busy."""
        assert self.step is None, "a step is already running"
        p = self.params
        bt = p.block_tokens
        decodes: list[Seq] = []
        preempted = False  # no admissions in a step that had to preempt
        # decodes first: each needs one token, and a block when it crosses a boundary
        i = 0
        while i < len(self.running):
            s = self.running[i]
            if not s.decoding:  # still prefilling
                i += 1
                continue
            # a new block only when the next token starts one (checked cheaply first)
            ctx = s.prompt + s.generated
            need = self._private_needed(s, ctx + 1) if ctx % bt == 0 else 0
            if need > 0 and not self._evict(need):
                victim = self._preempt_newest()
                preempted = True
                if victim is s:
                    continue  # s itself was the newest: it waits now
                continue  # retry s (still at index i) with the freed blocks
            if need > 0:
                s.private += need
                self.private += need
            decodes.append(s)
            i += 1
        budget = p.chunk_tokens - len(decodes)
        chunks: list[tuple[Seq, int]] = []
        for s in self.running:
            if budget <= 0:
                break
            if not s.decoding:
                c = min(s.context - s.computed, budget)
                chunks.append((s, c))
                budget -= c
        while not preempted and budget > 0 and self.waiting and len(self.running) < p.max_seqs:
            s = self.waiting[0]
            if not self._admit(s):
                break  # head of line waits for blocks (FCFS, as vLLM)
            self.waiting.popleft()
            self.running.append(s)
            c = min(s.context - s.computed, budget)
            chunks.append((s, c))
            budget -= c
        if not decodes and not chunks:
            return 0.0
        tokens = len(decodes) + sum(c for _, c in chunks)
        kv = sum([s.prompt + s.generated for s in decodes]) + sum(s.computed + c for s, c in chunks)
        dur = p.step_base_s + p.per_token_s * (tokens - 1) + p.per_kv_token_s * kv
        self.step = _Step(decodes, chunks, dur)
        return dur

    def end(self, now: float) -> tuple[list[Seq], list[Seq]]:
        """Finish the running step at ``now``; returns the sequences that produced their
        first token in it and those that completed."""
        st = self.step
        assert st is not None, "no step is running"
        self.step = None
        self.steps += 1
        self.busy_s += st.duration
        self.longest_step_s = max(self.longest_step_s, st.duration)
        finished: list[Seq] = []
        first: list[Seq] = []
        gaps = self.gaps
        for s in st.decodes:
            s.computed += 1
            self._token(s, now, gaps)
        for s, c in st.chunks:
            s.computed += c
            self.computed_tokens += c
            self._mark(s)
            if s.computed >= s.context:  # prefill (or recompute) done: it samples a token
                s.decoding = True
                if s.generated == 0:
                    first.append(s)
                self._token(s, now, gaps)
        self.decoded_tokens += len(st.decodes)
        keep: list[Seq] = []
        for s in self.running:
            if s.generated >= s.out:
                s.done = now
                self._release(s)
                finished.append(s)
            else:
                keep.append(s)
        self.running = keep
        return first, finished

    @staticmethod
    def _token(s: Seq, now: float, gaps: dict[float, int]) -> None:
        if s.generated == 0:
            s.first_token = now
        else:
            gap = now - s.last_token
            if gap > s.gap_max:
                s.gap_max = gap
            k = round(gap * 1000.0, 1)
            gaps[k] = gaps.get(k, 0) + 1
        s.generated += 1
        s.last_token = now

    # ---- invariants (tests) ---------------------------------------------------------------

    def check(self) -> None:
        """Assert the block accounting is consistent (for tests)."""
        refs: dict[int, int] = {}
        priv = 0
        for s in self.running:
            for b in s.ids[: s.named]:
                refs[b] = refs.get(b, 0) + 1
            priv += s.private
            assert s.computed <= s.context
            assert not s.decoding or s.computed == s.context - 1
        assert refs == self.ref, "named block references out of step with the sequences"
        assert priv == self.private, "private blocks out of step with the sequences"
        assert not (set(self.lru) & set(self.ref)), "a referenced block is in the LRU"
        assert self.ready <= set(self.ref), "a computed block neither referenced nor cached"
        for s in self.running:
            assert set(s.ids[: s.marked]) <= self.ready
        assert len(self.ref) + self.private + len(self.lru) <= self.params.blocks
        for s in self.waiting:
            assert s.named == 0
            assert s.private == 0


def replay(
    params: EngineParams,
    seqs: Iterable[Seq],
    audit: bool = False,
    on_step: Callable[[Engine], object] | None = None,
) -> Engine:
    """Run one engine over ``seqs``, each submitted at its ``arrival`` (seconds), by the
    clock rule of the module docstring, until all finish; returns the engine (the
    sequences record their times). ``audit``: :meth:`Engine.check` after every step;
    ``on_step``: called with the engine after every step (its KV events recorded)."""
    e = Engine(params)
    if on_step is not None:
        e.kv_events = []
    order = sorted(seqs, key=lambda s: s.arrival)
    now, k, n = 0.0, 0, len(order)
    while k < n or e.has_work():
        if not e.has_work():
            now = max(now, order[k].arrival)  # idle: the next arrival, not a tick
        while k < n and order[k].arrival <= now:
            e.submit(order[k])
            k += 1
        end = e.start(now)
        if end is None:
            raise RuntimeError("the engine has work it cannot schedule")
        now = end
        e.end(now)
        if audit:
            e.check()
        if on_step is not None:
            on_step(e)
    return e
