"""Turn admission: a POST's turn, from its idempotency key to its open generation.

Admission (:meth:`TurnManager.start_turn`, while the POST waits):

1. the ``Idempotency-Key`` is claimed (SET NX, for the turn lock's TTL, with a
   fingerprint of the request); a key seen before returns its turn, a key seen with
   another request is :class:`IdempotencyKeyReused` (-> 422);
2. the session's turn lock is taken (one turn generates at a time per session; a second
   POST gets :class:`TurnBusy` -> 409 with the running turn);
3. history and system prompt are read; the prompt is system + history + the new message;
4. the router picks the engine from the routing key, waiting up to ``admit_wait_s`` for a
   slot (:class:`AllEnginesFull` after it -> 429);
5. a fenced generation is opened and the ``meta`` frame published (the user's message,
   engine, preferred engine, spilled): its offset is the turn's first offset (the 202).

Then the turn is :class:`worker.chat.runner.TurnRunner`'s: :meth:`TurnRunner.run` runs
as a supervised task per turn (``turn:<sid>``) until the turn's one terminal frame; a
turn in :attr:`TurnManager.running` leaves it when it ends. :meth:`TurnManager.abort_engine`
(the control plane saw an engine leave) and :meth:`TurnManager.drain` (shutdown) end
running turns through :meth:`worker.chat.turnstate.RunningTurn.abort`.

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
from typing import Any

from relay.broker.errors import RedisUnavailable, RelayError
from relay.broker.rediscluster.publisher import Draft, Generation, Publisher
from relay.service.supervise import Supervisor
from worker.chat.direct import DirectViewer
from worker.chat.runner import TurnRunner
from worker.chat.store import SessionStore
from worker.chat.turnstate import (
    AbortReason,
    Draining,
    IdempotencyKeyReused,
    IdempotencyPending,
    LockLost,
    RunningTurn,
    StreamChat,
    TurnBusy,
    TurnConfig,
    TurnOutcome,
    TurnStarted,
    message_meta,
    request_fingerprint,
)
from worker.metrics import WorkerMetrics
from worker.routing.cost import turn_info
from worker.routing.key import routing_key
from worker.routing.lease import Lease, release_once
from worker.routing.ring import key_hash
from worker.routing.router import Router
from worker.routing.wait import route_wait

__all__ = [
    "TurnManager",
]


class TurnManager:
    """Admits turns and hands them to its runner; one per worker app."""

    def __init__(
        self,
        *,
        publisher: Publisher,
        store: SessionStore,
        router: Router,
        engine: StreamChat,
        metrics: WorkerMetrics,
        worker_id: str,
        config: TurnConfig | None = None,
        supervisor: Supervisor | None = None,
    ) -> None:
        self.publisher = publisher
        self.store = store
        self.router = router
        self.metrics = metrics
        self.worker_id = worker_id
        self.cfg = config or TurnConfig()
        # turns and their presence checks run as the supervisor's tasks: a failure is
        # logged with its traceback, never lost, and stop() cancels what is left
        self.supervisor = supervisor or Supervisor()
        self.running: dict[str, RunningTurn] = {}
        self.draining = False
        self.redis_ready = True  # False while start-up has not reached Redis yet
        # The most recent (sid, turn, outcome), for tests and debugging; bounded, so a
        # long-running worker does not keep one entry per turn it ever ran.
        self.outcomes: deque[tuple[str, int, TurnOutcome]] = deque(maxlen=1000)
        # Recent placements on the ring (GET /v1/router, the demo's live panel): where a
        # turn's routing key fell and which engine served it, never the session id.
        self.placements: deque[dict[str, Any]] = deque(maxlen=50)
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
        message: str,
        *,
        system: str | None = None,
        max_tokens: int | None = None,
        idempotency_key: str | None = None,
        viewer: DirectViewer | None = None,
        conversation: list[dict[str, str]] | None = None,
    ) -> TurnStarted:
        """Admit a turn and start it; ``viewer`` (closed loop) receives its frames.
        ``conversation`` (the OpenAI gateway's messages, ending with ``message``) is the
        prompt instead of the session's stored history; the exchange is stored as usual."""
        if self.draining:
            raise Draining("worker is shutting down")
        if not self.redis_ready:
            raise RedisUnavailable("redis has not been reached yet")
        owner = f"{self.worker_id}:{uuid.uuid4().hex[:16]}"
        fp = request_fingerprint(message, system, max_tokens)
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
                sid, owner, message, system, max_tokens, idem, viewer, conversation
            )
        except BaseException:
            if idempotency_key is not None:
                with contextlib.suppress(RelayError):
                    await self.store.drop_idempotency(sid, idempotency_key, owner)
            raise

    async def _admit(
        self,
        sid: str,
        owner: str,
        message: str,
        system: str | None,
        max_tokens: int | None,
        idem: tuple[str, str] | None,
        viewer: DirectViewer | None = None,
        conversation: list[dict[str, str]] | None = None,
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
        opened: Generation | None = None
        try:
            hist = await self.store.load(sid)
            sys_prompt = system if system else hist.system
            prior = hist.messages if conversation is None else conversation[:-1]
            convo = [*prior, {"role": "user", "content": message}]
            rkey = routing_key(sys_prompt, convo, prefix_chars=self.cfg.prefix_chars)
            info = turn_info(rkey, sys_prompt, prior, message, hist.last_engine)
            lease = await route_wait(self.router, rkey, self.cfg.admit_wait_s, info)
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
            if system and system != hist.system:
                await self.store.save_system(sid, system)
            gen = await self.publisher.open_generation(sid)
            if viewer is not None:
                gen.observers.append(viewer)
            offset = (
                await gen.publish(
                    [
                        Draft(
                            kind="meta",
                            meta={
                                "role": "user",
                                **message_meta(message),  # bounded: the history has it all
                                "engine": lease.engine.id,
                                "preferred": lease.preferred,
                                "spilled": lease.spilled,
                                "model": self.cfg.model,
                                "worker": self.worker_id,
                            },
                        )
                    ]
                )
            )[0]
            opened = gen  # its meta frame is out: a failure from here on needs an error frame
            started = TurnStarted(sid, gen.turn, offset)
            if not await self.store.set_lock_turn(sid, owner, gen.turn, offset):
                raise LockLost("the turn lock expired while the turn was admitted")
            if idem is not None:
                await self.store.resolve_idempotency(sid, idem[0], started.body(), idem[1])
        except BaseException:
            release_once(lease)
            if opened is not None:
                with contextlib.suppress(RelayError):
                    await opened.error("turn failed to start")
            with contextlib.suppress(RelayError):
                await self.store.release_lock(sid, owner)
            raise
        prompt = [{"role": "system", "content": sys_prompt}] if sys_prompt else []
        prompt += convo
        turn = RunningTurn(
            sid, gen, lease, owner, prompt, message, max_tokens, t0, rkey, viewer=viewer
        )
        self.running[sid] = turn
        turn.task = self.supervisor.spawn(f"turn:{sid}", self.runner.run(turn))
        return started

    # ---- aborts ------------------------------------------------------------------------------

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
