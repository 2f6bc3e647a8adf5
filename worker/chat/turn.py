"""Turn admission: a POST's turn, from its idempotency key to its open generation.

Admission (:meth:`TurnManager.start_turn`, while the POST waits):

1. the ``Idempotency-Key`` is claimed (SET NX, for the turn lock's TTL, with a
   fingerprint of the request); a key seen before returns its turn, a key seen with
   another request is :class:`IdempotencyKeyReused` (-> 422);
2. the session's turn lock is taken (one turn generates at a time per session; a second
   POST gets :class:`TurnBusy` -> 409 with the running turn);
3. history and system prompt are read; the prompt is system + history + the new message;
4. the router picks the engine from the routing key, waiting up to ``admit_wait_s`` for a
   slot (:class:`AllEnginesFull` after it -> 429); the prompt is trimmed to that engine's
   context (:mod:`worker.chat.trim`, ``trimmed_messages`` in the ``meta`` frame);
5. a fenced generation is opened and the ``meta`` frame published (the user's message,
   engine, preferred engine, spilled): its offset is the turn's first offset (the 202).

Then the turn is :class:`worker.chat.runner.TurnRunner`'s: :meth:`TurnRunner.run` runs
as a supervised task per turn (``turn:<sid>``) until the turn's one terminal frame; a
turn in :attr:`TurnManager.running` leaves it when it ends. :meth:`TurnManager.abort_engine`
(the control plane saw an engine leave) and :meth:`TurnManager.drain` (shutdown) end
running turns through :meth:`worker.chat.turnstate.RunningTurn.abort`; so does
:meth:`TurnManager.stop` (a client's stop, :mod:`worker.chat.cancel`), from any worker.
A regenerate or an edit (``replaces``, :mod:`worker.chat.replace`) is a turn whose
prompt is the history before the replaced turn, which leaves the history at admission.

A failure before the turn is handed over gives everything back: the lease is released,
an ``error`` frame ends a generation whose ``meta`` frame is out, the lock is released
and the idempotency claim dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import deque
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

from relay.broker.errors import RedisUnavailable, RelayError
from relay.producer import Claim, Producer, Turn
from relay.producer.coalesce import Batch
from relay.service.supervise import Supervisor
from worker.chat.cancel import ControlChannel, StopStatus, StopVerdict, owner_worker, request_stop
from worker.chat.direct import DirectViewer
from worker.chat.replace import Replace, resolve_replace
from worker.chat.runner import TurnRunner
from worker.chat.store import SessionStore
from worker.chat.trim import trim_to_context
from worker.chat.turnstate import (
    AbortReason,
    Draining,
    IdempotencyKeyReused,
    IdempotencyPending,
    RunningTurn,
    StreamChat,
    TurnBusy,
    TurnCancelled,
    TurnConfig,
    TurnOutcome,
    TurnStarted,
    request_fingerprint,
)
from worker.metrics import WorkerMetrics
from worker.routing.cost import turn_info
from worker.routing.key import routing_key
from worker.routing.lease import Lease, release_once
from worker.routing.ring import key_hash
from worker.routing.router import Router
from worker.routing.tokens import PromptTokenizer, block_keys, prompt_ids
from worker.routing.wait import route_wait

__all__ = [
    "TurnManager",
]


class _Admission:
    """A turn between its lock and its start: a stop sets ``stopped``, which takes it
    out of the wait for an engine slot (:meth:`wait`)."""

    __slots__ = ("owner", "stopped")

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.stopped = asyncio.Event()

    async def wait(self, routed: Coroutine[Any, Any, Lease]) -> Lease:
        """``routed`` (the wait for a slot), unless a stop comes first: TurnCancelled."""
        if self.stopped.is_set():
            routed.close()
            raise TurnCancelled("the turn was stopped before it started")
        task = asyncio.ensure_future(routed)
        stop = asyncio.ensure_future(self.stopped.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.stopped.is_set():
            if not task.cancelled() and task.exception() is None:
                release_once(task.result())
            raise TurnCancelled("the turn was stopped while it waited for an engine slot")
        return task.result()


class TurnManager:
    """Admits turns and hands them to its runner; one per worker app."""

    def __init__(
        self,
        *,
        store: SessionStore,
        router: Router,
        engine: StreamChat,
        metrics: WorkerMetrics,
        worker_id: str,
        config: TurnConfig | None = None,
        supervisor: Supervisor | None = None,
        tokenizer: PromptTokenizer | None = None,
    ) -> None:
        self.store = store
        self.router = router
        # precise routing: the served model's tokenizer (None: the mock model's, known here)
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.worker_id = worker_id
        self.cfg = config or TurnConfig()
        # turns and their presence checks run as the supervisor's tasks: a failure is
        # logged with its traceback, never lost, and stop() cancels what is left
        self.supervisor = supervisor or Supervisor()
        self.running: dict[str, RunningTurn] = {}
        self.admitting: dict[str, _Admission] = {}  # turns between the lock and running
        # stops from other workers arrive here (started with Redis: start_control)
        self.control = ControlChannel(
            store.store.messages(f"ctl-{worker_id}"), worker_id, self.on_stop
        )
        self.draining = False
        self.redis_ready = True  # False while start-up has not reached Redis yet
        # The most recent (sid, turn, outcome), for tests and debugging; bounded, so a
        # long-running worker does not keep one entry per turn it ever ran.
        self.outcomes: deque[tuple[str, int, TurnOutcome]] = deque(maxlen=1000)
        # Recent placements on the ring (GET /v1/router, the demo's live panel): where a
        # turn's routing key fell and which engine served it, never the session id.
        self.placements: deque[dict[str, Any]] = deque(maxlen=50)
        # the one producer implementation: the worker's turns are written with it
        self.producer = Producer(
            store.store,  # its turns are written with the sessions' store
            producer_id=worker_id,
            lock_ttl_s=store.lock_ttl_ms / 1000,
            coalesce=self.cfg.coalesce,
            presence=self.cfg.presence,
            spawn=self.supervisor.spawn,
        )
        self.runner = TurnRunner(
            store=store,
            router=router,
            engine=engine,
            metrics=metrics,
            config=self.cfg,
            supervisor=self.supervisor,
            running=self.running,
            outcomes=self.outcomes,
        )

    # ---- admission -------------------------------------------------------------------------

    async def start_turn(
        self,
        sid: str,
        message: str | None,
        *,
        system: str | None = None,
        max_tokens: int | None = None,
        idempotency_key: str | None = None,
        viewer: DirectViewer | None = None,
        conversation: list[dict[str, Any]] | None = None,
        replaces: Replace | None = None,
        message_id: str | None = None,
        response: Mapping[str, Any] | None = None,
        background: bool = False,
        options: Mapping[str, Any] | None = None,
        tool_results: Sequence[Mapping[str, Any]] = (),
    ) -> TurnStarted:
        """Admit a turn and start it; ``viewer`` (closed loop) receives its frames.
        ``conversation`` (the OpenAI gateway's messages, ending with ``message``) is the
        prompt instead of the session's stored history; the exchange is stored as usual.
        ``replaces``: the turn regenerates (``message`` None: the replaced turn's user
        message again) or edits an earlier turn, whose messages and every later turn's
        leave the history; its ``meta`` frame says ``replaces`` so screens drop them too.
        ``message_id``: the client's id of the user message (kept in the history).
        ``response``: the Responses API's request parameters, in the ``meta`` frame (any
        pod builds the response object from it); ``background``: the turn runs to its
        end with nobody watching (its worker counts as its watcher). ``options``: what
        the engine gets besides the prompt (the gateway's tools, ``stop``, sampling).
        ``tool_results``: the results of the calls of an earlier reply that the client
        ran (``{"role": "tool", "tool_call_id", "content"}``), sent before ``message``;
        ``message`` may then be empty (the turn continues after the tools); they are
        stored in the history with the turn. ``conversation`` ends with this new
        input."""
        if self.draining:
            raise Draining("worker is shutting down")
        if not self.redis_ready:
            raise RedisUnavailable("redis has not been reached yet")
        owner = f"{self.worker_id}:{uuid.uuid4().hex[:16]}"
        fp = request_fingerprint(
            message or "", system, max_tokens, None if replaces is None else replaces.key(),
            options, tool_results,
        )  # fmt: skip
        if idempotency_key is not None:
            seen = await self.store.claim_idempotency(sid, idempotency_key, owner, fp)
            if isinstance(seen, dict):
                return TurnStarted(sid, int(seen["turn"]), int(seen["offset"]), replayed=True)
            if seen == "reused":
                raise IdempotencyKeyReused(
                    "this Idempotency-Key was used with a different request body"
                )
            if seen == "pending":
                raise IdempotencyPending("a request with this Idempotency-Key is in progress")
        try:
            idem = (idempotency_key, fp) if idempotency_key is not None else None
            return await self._admit(
                sid, owner, message, system, max_tokens, idem, viewer, conversation,
                replaces, message_id, response=response, background=background,
                options=options, tool_results=tool_results,
            )  # fmt: skip
        except BaseException:
            if idempotency_key is not None:
                with contextlib.suppress(RelayError):
                    await self.store.drop_idempotency(sid, idempotency_key, owner)
            raise

    async def _admit(
        self,
        sid: str,
        owner: str,
        message: str | None,
        system: str | None,
        max_tokens: int | None,
        idem: tuple[str, str] | None,
        viewer: DirectViewer | None = None,
        conversation: list[dict[str, Any]] | None = None,
        replaces: Replace | None = None,
        message_id: str | None = None,
        *,
        response: Mapping[str, Any] | None = None,
        background: bool = False,
        options: Mapping[str, Any] | None = None,
        tool_results: Sequence[Mapping[str, Any]] = (),
    ) -> TurnStarted:
        t0 = time.monotonic()
        for attempt in range(self.cfg.lock_retry + 1):
            holder = await self.store.acquire_lock(sid, owner)
            if holder is None:
                break
            if attempt == self.cfg.lock_retry:
                raise TurnBusy(holder)
            await asyncio.sleep(self.cfg.lock_retry_s)
        lease: Lease | None = None
        opened: Turn | None = None
        adm = self.admitting[sid] = _Admission(owner)
        try:
            hist = await self.store.load(sid)
            sys_prompt = system if system else hist.system
            replaced, message, replaced_id = resolve_replace(hist, replaces, message)
            message_id = message_id or replaced_id
            # a replaced turn that went on after tools is asked again with the same results
            results = (
                [dict(m) for m in tool_results] if replaced is None
                else hist.tool_results(replaced)
            )  # fmt: skip
            new = [*results, *([{"role": "user", "content": message}] if message else [])]
            if conversation is not None:
                prior = conversation[: len(conversation) - len(new)]
            elif replaced is not None:
                prior = hist.before(replaced)
            else:
                prior = hist.messages
            convo = [*prior, *new]
            rkey = routing_key(sys_prompt, convo, prefix_chars=self.cfg.prefix_chars)
            prompt = [{"role": "system", "content": sys_prompt}] if sys_prompt else []
            prompt += convo
            info = turn_info(
                rkey, sys_prompt, [*prior, *results], message, hist.last_engine,
                await self._blocks(prompt),
            )  # fmt: skip
            lease = await adm.wait(route_wait(self.router, rkey, self.cfg.admit_wait_s, info))
            self.metrics.route_decisions.labels(self.router.policy, lease.reason).inc()
            if hist.last_engine is not None and any(
                s.id == hist.last_engine for s in self.router.engines()
            ):
                self.metrics.affinity_available.inc()
                if lease.engine.id == hist.last_engine:
                    self.metrics.affinity_captured.inc()
            if lease.spilled:
                self.metrics.spills.inc()
            self.placements.appendleft(
                {
                    "point": f"{key_hash(rkey):08x}",  # where on the ring; no session id
                    "engine": lease.engine.id,
                    "preferred": lease.preferred,
                    "spilled": lease.spilled,
                    "ts": time.time(),  # wall clock: when, for the demo's panel
                }
            )
            # the engine's context: its oldest turns left out (the history keeps them)
            context = self.router.profiles.get(lease.engine.id).context_tokens
            prompt, trimmed = trim_to_context(prompt, context, max_tokens)
            if system and system != hist.system:
                await self.store.save_system(sid, system)
            if replaced is not None:  # the replaced turns leave the history now
                await self.store.truncate_from(sid, replaced)
            extra: dict[str, Any] = {
                "engine": lease.engine.id,
                "preferred": lease.preferred,
                "spilled": lease.spilled,
                "model": self.cfg.model,
            }
            if replaced is not None:
                extra["replaces"] = replaced
            if trimmed:
                extra["trimmed_messages"] = trimmed
            if response is not None:
                extra["response"] = dict(response)
            # the producer API writes the turn: generation, meta frame, the lock named
            gen = await Claim(self.producer.session(sid), owner).open(
                message,
                message_id=message_id,
                meta=extra,
                observers=[viewer] if viewer is not None else (),
                watch=False,  # the runner starts the watch once the turn runs
                on_batch=self._count_batch,
            )
            opened = gen  # its meta frame is out: a failure from here on needs an error frame
            offset = gen.first_offset
            started = TurnStarted(sid, gen.turn, offset)
            if idem is not None:
                await self.store.resolve_idempotency(sid, idem[0], started.body(), idem[1])
        except BaseException:
            release_once(lease)
            if opened is not None:
                with contextlib.suppress(RelayError):
                    await opened.error("turn failed to start", code=None)
            with contextlib.suppress(RelayError):
                await self.store.release_lock(sid, owner)
            raise
        finally:
            if self.admitting.get(sid) is adm:
                del self.admitting[sid]
        turn = RunningTurn(
            sid, gen, lease, owner, prompt, message, max_tokens, t0, rkey, viewer=viewer,
            first_offset=offset, user_id=message_id or "", background=background,
            reply_seed=None if replaced is None else gen.turn,
            options=dict(options or {}),
            trimmed=trimmed, tool_results=results,
        )  # fmt: skip
        self.running[sid] = turn
        if adm.stopped.is_set():  # a stop that came after the wait: carried out at once
            turn.abort(AbortReason.CANCELLED)
        turn.task = self.supervisor.spawn(f"turn:{sid}", self.runner.run(turn))
        return started

    def _count_batch(self, b: Batch) -> None:
        self.metrics.publishes.inc()
        self.metrics.tokens.inc(b.count)
        for w in b.waits:
            self.metrics.coalesce_wait.observe(w)

    # ---- stop ----------------------------------------------------------------------------------

    async def stop(self, sid: str, turn: int) -> StopVerdict:
        """Stop ``turn`` of ``sid`` (0: whichever runs or waits), whichever worker runs
        it: record it, then abort it here or tell its worker (:mod:`worker.chat.cancel`)."""
        v = await request_stop(self.store.store, sid, turn, self.store.ttl_s)
        if v.status in (StopStatus.STOPPING, StopStatus.ADMITTING) and v.owner:
            worker = owner_worker(v.owner)
            if worker == self.worker_id:
                self.on_stop(sid, v.turn, v.owner)
            else:
                await self.control.notify(worker, sid, v.turn, v.owner)
        return v

    def on_stop(self, sid: str, turn: int, owner: str) -> None:
        """A stop for a turn this worker runs (``turn`` 0: the one being admitted)."""
        t = self.running.get(sid)
        if t is not None and t.owner == owner and turn in (0, t.gen.turn):
            t.abort(AbortReason.CANCELLED)
            return
        adm = self.admitting.get(sid)
        if adm is not None and adm.owner == owner:
            adm.stopped.set()

    # ---- aborts ------------------------------------------------------------------------------

    async def _blocks(self, prompt: list[dict[str, str]]) -> list[int]:
        """precise: the prompt's block keys, as the served model's tokenizer renders it
        (the mock engine's, worker.routing.tokens, or the engine's own, asked within a
        bounded time: none when it does not answer, and the turn is routed by the
        estimate); none for the other policies."""
        index = self.router.index
        if index is None:
            return []
        if self.tokenizer is None:
            return block_keys(prompt_ids(prompt), index.block_size)
        ids = await self.tokenizer(prompt)
        return block_keys(ids, index.block_size) if ids else []

    def abort_engine(self, engine_id: str, reason: str = AbortReason.ENGINE_DOWN) -> int:
        """End every running turn on ``engine_id`` (the control plane saw it leave)."""
        why = AbortReason(reason)  # ValueError for a reason no outcome stands for
        n = 0
        for t in list(self.running.values()):
            if t.lease.engine.id == engine_id:
                t.abort(why)
                n += 1
        return n

    async def drain(self, deadline_s: float) -> None:
        """Stop admitting; let running turns finish for ``deadline_s``, then abort them
        with "worker shutdown" and wait for their terminal frames."""
        self.draining = True
        tasks = [t.task for t in self.running.values() if t.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=deadline_s)
            if pending:
                for t in list(self.running.values()):
                    t.abort(AbortReason.SHUTDOWN)
                await asyncio.wait(pending, timeout=5.0)
