"""Offline jobs on the real RabbitMQ broker of this machine and the real cluster.

Each test uses its own queue names (deleted after), an in-process worker with ``--amqp``
(tests/support/worker.py) and in-process job runners. Skipped with the reason where no
broker could be started (the ``amqp`` fixture: a RabbitMQ of the run's own).
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp
import pytest
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from devstack.procs import Proc
from relay.broker.rediscluster.publisher import read_backlog
from relay.broker.rediscluster.store import RedisStore
from relay.protocol.frame import decode
from tests.support.cli import run_cli, tokenrelay
from tests.support.worker import Harness, expected_reply
from worker.chat.store import SessionStore
from worker.engines.client import EngineClient
from worker.jobs.queue import JobRunner, QueueNames, RunnerConfig
from worker.jobs.record import JobSpec, JobStore, new_job_id, within_reserve
from worker.routing.lease import EngineSpec
from worker.routing.router import Router

pytestmark = pytest.mark.integration

KEY = "jobs-test-key-0123456789"


@pytest.fixture
async def names(amqp: str) -> AsyncIterator[QueueNames]:
    q = QueueNames(f"tokenrelay.test.{uuid.uuid4().hex[:8]}", max_attempts=2)
    yield q
    conn = await aio_pika.connect(amqp)
    try:
        ch = await conn.channel()
        for name in (q.queue, q.dead):
            await ch.queue_delete(name, if_unused=False, if_empty=False)
        await ch.exchange_delete(q.dlx)
    finally:
        await conn.close()


class Runners:
    """Job runners in this process, stopped after the test."""

    def __init__(self, h: Harness, redis: RedisCluster, names: QueueNames, amqp: str) -> None:
        self.h, self.redis, self.names, self.amqp = h, redis, names, amqp
        self.http = aiohttp.ClientSession()
        self.started: list[JobRunner] = []

    async def start(self, engines: list[EngineSpec] | None = None, **cfg: Any) -> JobRunner:
        specs = engines or [
            EngineSpec(id=e.engine.cfg.engine_id, url=e.url, cap=4) for e in self.h.engines
        ]
        cfg.setdefault("backoff_s", 0.05)
        cfg.setdefault("route_wait_s", 1.0)
        runner = JobRunner(
            self.amqp,
            self.names,
            jobs=JobStore(self.redis),
            router=Router(specs),
            engine=EngineClient(self.http),
            turns=RedisStore(self.redis),
            sessions=SessionStore(self.redis),
            cfg=RunnerConfig(worker_id=f"jr-{len(self.started)}", **cfg),
        )
        await runner.start()
        self.started.append(runner)
        return runner

    async def close(self) -> None:
        for r in self.started:
            await r.stop(1.0)
        await self.http.close()


@pytest.fixture
async def runners(
    h: Harness, redis: RedisCluster, names: QueueNames, amqp: str
) -> AsyncIterator[Runners]:
    rs = Runners(h, redis, names, amqp)
    yield rs
    await rs.close()


async def _worker(h: Harness, names: QueueNames, amqp: str, **kw: Any) -> None:
    await h.start_worker(amqp_url=amqp, jobs_queue=names.queue, gateway_keys=(KEY,), **kw)


async def _submit(h: Harness, body: dict[str, Any], **headers: str) -> tuple[int, dict[str, Any]]:
    assert h.http is not None
    hdrs = {"Authorization": f"Bearer {KEY}", **headers}
    async with h.http.post(h.url("/v1/jobs"), json=body, headers=hdrs) as r:
        return r.status, await r.json()


async def _poll(h: Harness, job: str, until: str, timeout_s: float = 20.0) -> dict[str, Any]:
    assert h.http is not None
    deadline = time.monotonic() + timeout_s
    while True:
        async with h.http.get(h.url(f"/v1/jobs/{job}"),
                              headers={"Authorization": f"Bearer {KEY}"}) as r:  # fmt: skip
            assert r.status == 200, await r.text()
            body: dict[str, Any] = await r.json()
        if body["status"] == until:
            return body
        assert time.monotonic() < deadline, body
        await asyncio.sleep(0.05)


async def test_a_job_runs_once_and_its_whole_result_is_stored(
    h: Harness, names: QueueNames, runners: Runners, amqp: str
) -> None:
    await h.start_engines(2)
    await _worker(h, names, amqp)
    await runners.start()
    status, body = await _submit(h, {"prompt": "Write the case report.", "max_tokens": 30},
                                 **{"Idempotency-Key": "report-1"})  # fmt: skip
    assert status == 202
    again_status, again = await _submit(h, {"prompt": "Write the case report.", "max_tokens": 30},
                                        **{"Idempotency-Key": "report-1"})  # fmt: skip
    assert again_status == 202
    assert again["job"] == body["job"]
    done = await _poll(h, body["job"], "done")
    want = expected_reply([{"role": "user", "content": "Write the case report."}], 30)
    assert done["result"] == want
    assert done["sha256"] == hashlib.sha256(want.encode()).hexdigest()
    assert done["chars"] == len(want)
    assert done["attempts"] == 1


async def test_a_job_worker_killed_mid_job_leads_to_redelivery_and_one_result(
    h: Harness, redis: RedisCluster, names: QueueNames, runners: Runners, amqp: str
) -> None:
    await h.start_engines(1, decode_tok_per_s=15.0)
    await _worker(h, names, amqp)
    first = await runners.start()
    _, body = await _submit(h, {"prompt": "A long report, please.", "max_tokens": 40})
    job = body["job"]
    await _poll(h, job, "running")
    await first.stop(0.0)  # killed: the job is cancelled before its ack
    rec = await JobStore(redis).get(job)
    assert rec is not None
    assert rec["status"] == "running"
    assert "result" not in rec  # the fault took effect: no result from the first runner
    await runners.start()
    done = await _poll(h, job, "done", timeout_s=30)
    assert done["attempts"] == 2
    assert done["result"] == expected_reply(
        [{"role": "user", "content": "A long report, please."}], 40
    )
    store = JobStore(redis)
    assert await store.finish(job, {"result": "a second result"}) is False  # one result kept
    assert (await store.get(job) or {})["result"] == done["result"]


async def test_a_poison_job_goes_to_the_dead_letter_queue_after_max_attempts(
    h: Harness, redis: RedisCluster, names: QueueNames, runners: Runners, amqp: str
) -> None:
    await h.start_engines(1)
    await _worker(h, names, amqp)
    dead_engine = [EngineSpec(id="gone", url="http://127.0.0.1:9", cap=4)]  # nothing listens
    await runners.start(engines=dead_engine)
    _, body = await _submit(h, {"prompt": "never works"})
    failed = await _poll(h, body["job"], "failed", timeout_s=30)
    assert "gave up after 2 attempts" in failed["error"]
    conn = await aio_pika.connect(amqp)
    try:
        ch = await conn.channel()
        dead = await ch.declare_queue(names.dead, passive=True)
        for _ in range(50):
            if dead.declaration_result.message_count == 1:
                break
            await asyncio.sleep(0.05)
            dead = await ch.declare_queue(names.dead, passive=True)
        assert dead.declaration_result.message_count == 1
    finally:
        await conn.close()


async def test_a_session_job_is_delivered_on_the_session_as_one_whole_reply(
    h: Harness, redis: RedisCluster, names: QueueNames, runners: Runners, amqp: str
) -> None:
    await h.start_engines(1)
    await _worker(h, names, amqp)
    await runners.start()
    sid, token = await h.session()
    # the operator's key submits session-less jobs only: a session's job needs its token
    status, body = await _submit(h, {"prompt": "into your session", "session": sid})
    assert (status, body["error"]) == (403, "session_token_required"), body
    status, body = await _submit(
        h, {"prompt": "Summarise the ward round.", "max_tokens": 25, "session": sid},
        Authorization=f"Bearer {token}",
    )  # fmt: skip
    assert status == 202
    done = await _poll(h, body["job"], "done")
    for _ in range(100):
        raw, _, _ = await read_backlog(redis, sid, 0, 100)
        frames = [decode(x) for x in raw]
        if frames and frames[-1].kind == "done":
            break
        await asyncio.sleep(0.05)
    kinds = [f.kind for f in frames]
    assert kinds == ["meta", "token", "done"]
    assert frames[0].meta is not None
    assert frames[0].meta["job"] == body["job"]
    assert frames[1].text == done["result"]
    assert frames[2].meta is not None
    assert frames[2].meta["sha256"] == done["sha256"]
    for _ in range(100):  # the record says so once the frames are out
        rec = await JobStore(redis).get(body["job"]) or {}
        if "notified" in rec:
            break
        await asyncio.sleep(0.02)
    assert rec["notified"] == "1"


async def test_bad_requests_and_an_unreachable_broker_are_clear_refusals(
    h: Harness, redis: RedisCluster, names: QueueNames
) -> None:
    await h.start_engines(1)
    await h.start_worker(amqp_url="amqp://guest:guest@127.0.0.1:9/", gateway_keys=(KEY,))
    assert h.http is not None
    async with h.http.post(h.url("/v1/jobs"), json={"prompt": "x"}) as r:
        assert r.status == 401
    status, body = await _submit(h, {"prompt": ""})
    assert (status, body["error"]) == (400, "invalid_job")
    status, body = await _submit(h, {"prompt": "x", "max_tokens": 0})
    assert (status, body["error"]) == (400, "invalid_job")
    status, body = await _submit(h, {"prompt": "x", "session": "{bad}"})
    assert (status, body["error"]) == (400, "invalid_job")
    status, body = await _submit(h, {"prompt": "queue is down"})
    assert (status, body["error"]) == (503, "queue_unavailable")
    async with h.http.get(h.url("/v1/jobs/not-a-job-id"),
                          headers={"Authorization": f"Bearer {KEY}"}) as r:  # fmt: skip
        assert r.status == 400
    async with h.http.get(h.url(f"/v1/jobs/{new_job_id()}"),
                          headers={"Authorization": f"Bearer {KEY}"}) as r:  # fmt: skip
        assert r.status == 404


def test_jobs_never_take_the_slots_reserved_for_chat() -> None:
    # cap 4, reserve 2: a job may hold a slot while the engine holds at most 2 in all
    assert within_reserve(1, 0, 4, 2)
    assert within_reserve(1, 1, 4, 2)
    assert not within_reserve(1, 2, 4, 2)  # chat holds 2: the job would eat the reserve
    assert not within_reserve(3, 0, 4, 2)
    assert within_reserve(1, 0, 1, 5)  # at least one slot, whatever the reserve


async def test_a_job_waits_while_chat_holds_the_reserve(
    h: Harness, names: QueueNames, runners: Runners, amqp: str
) -> None:
    await h.start_engines(1)
    await _worker(h, names, amqp)
    spec = [EngineSpec(id=h.engines[0].engine.cfg.engine_id, url=h.engines[0].url, cap=2)]
    runner = await runners.start(engines=spec, chat_reserve=1, route_wait_s=30.0)
    chat = runner.router.route("chat-key")  # chat holds the engine's last slot above 1
    try:
        _, body = await _submit(h, {"prompt": "waits for chat", "max_tokens": 8})
        await asyncio.sleep(1.0)
        rec = await JobStore(h.redis).get(body["job"]) or {}
        assert rec.get("status") == "running"  # picked up, waiting for room
        assert "result" not in rec
    finally:
        chat.release()
    done = await _poll(h, body["job"], "done")
    assert done["attempts"] == 1


async def test_store_rules_make_redelivery_safe(redis: RedisCluster) -> None:
    store = JobStore(redis, ttl_s=60)
    job = new_job_id()
    assert await store.start(job, "w") == ("missing", 0)
    await store.create(job, JobSpec(prompt="p"))
    assert await store.start(job, "w") == ("running", 1)
    assert await store.finish(job, {"result": "one"}) is True
    assert await store.start(job, "w") == ("done", 0)  # a duplicate delivery is a no-op
    assert await store.fail(job, "late failure") is False
    assert (await store.get(job) or {})["result"] == "one"


async def test_the_jobworker_command_runs_jobs_and_stops_cleanly_on_sigterm(
    h: Harness, names: QueueNames, cluster: ClusterInfo, tmp_path: Path, amqp: str
) -> None:
    await h.start_engines(1)
    await _worker(h, names, amqp)
    alive = tmp_path / "alive"
    argv = [sys.executable, "-m", "tokenrelay", "jobworker", "--redis", cluster.url,
            "--amqp", amqp, "--queue", names.queue, "--max-attempts", "2",
            "--engine", f"eng-0={h.engines[0].url}", "--health-file", str(alive)]  # fmt: skip
    proc = Proc.start(argv, log=tmp_path / "jobworker.out", err_log=tmp_path / "jobworker.err")
    try:
        _, body = await _submit(h, {"prompt": "from the command", "max_tokens": 8})
        done = await _poll(h, body["job"], "done", timeout_s=30)
        assert done["result"] == expected_reply(
            [{"role": "user", "content": "from the command"}], 8
        )
        assert alive.exists()
    finally:
        code = await proc.stop(grace_s=30)  # SIGTERM by pid: the process this test started
    assert code == 0, proc.output(stderr=True)
    assert "consuming" in proc.output()


async def test_jobworker_bad_flags_exit_2_with_one_line() -> None:
    r = await run_cli(
        tokenrelay("jobworker", "--redis", "redis://127.0.0.1:1", "--amqp", "amqp://guest:guest@127.0.0.1:9/",
                   "--engine", "not-a-url"),
        timeout_s=60,
    )  # fmt: skip
    assert r.code == 2
    assert r.err.count("\n") == 1
    assert r.err.startswith("error:")
