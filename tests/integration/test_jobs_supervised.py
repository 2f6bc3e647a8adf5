"""The job runner's consumer is a supervised loop: when it fails (here: its queue cannot
be opened once), the failure is logged with its traceback, the loop is started again
and jobs still run. Against the real RabbitMQ broker and Redis Cluster of the job tests
(the run's own: the amqp fixture)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aio_pika.abc import AbstractQueue

from tests.integration.test_jobs import Runners, _poll, _submit, _worker, names, runners
from tests.support.worker import Harness
from worker.jobs.queue import QueueNames

pytestmark = pytest.mark.integration

__all__ = ["names", "runners"]  # the fixtures, used by name


async def test_a_consumer_that_fails_is_started_again_and_jobs_still_run(
    h: Harness,
    names: QueueNames,
    runners: Runners,
    amqp: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    await h.start_engines(1)
    await _worker(h, names, amqp)
    with caplog.at_level(logging.ERROR, "relay.service.supervise"):
        runner = await runners.start()
        real_open = runner._open
        calls = 0

        async def open_once_broken() -> AbstractQueue:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("the consumer broke")
            return await real_open()

        # the consumer loop has not run yet: its first run fails
        runner._open = open_once_broken  # type: ignore[method-assign]
        assert runner._supervisor is not None
        loop = runner._supervisor.loops["job_consumer"]
        async with asyncio.timeout(20):
            while loop.restarts < 1:
                await asyncio.sleep(0.02)
        _, body = await _submit(h, {"prompt": "the report after the crash", "max_tokens": 10})
        done = await _poll(h, body["job"], "done")
    assert done["attempts"] == 1
    assert loop.failures == 1
    assert any("job_consumer" in r.getMessage() and r.exc_info is not None for r in caplog.records)
