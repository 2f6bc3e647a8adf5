"""The message-queue vs Pub/Sub benchmark on real brokers, at a tiny scale.

SPUBLISH runs on a cluster the benchmark starts (and stops by pid); the RabbitMQ modes
use a RabbitMQ of the run's own (the ``amqp`` fixture) and are skipped with the reason
where none can be started. Every token published at the paced rate
must reach its viewer, and the record must carry the documented keys.
"""

from __future__ import annotations

import asyncio

import pytest

from bench.pubsub import amqp_load as amqp_io
from bench.pubsub.mq_vs_pubsub import MODES, Workload, _reachable, markdown, run_all

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY = Workload(sessions=20, rate=20.0, paced_s=0.5, max_s=0.5, churn_s=0.3, churn_parallel=2)
KEYS = ("latency_p50_ms", "latency_p99_ms", "broker_cpu_us_per_token", "max_tokens_per_s")


async def _broker_or_skip(url: str) -> None:
    reason = await _reachable(url)
    if reason is not None:
        pytest.skip(f"the run's RabbitMQ does not answer at {url}: {reason}")


@pytest.mark.timeout(120)
async def test_every_mode_delivers_every_token_and_reports_its_costs(amqp: str) -> None:
    result = await run_all(TINY, amqp)
    spub = result["modes"]["spublish"]
    assert spub["delivered_ratio"] == 1.0
    assert spub["published"] == int(TINY.sessions * TINY.rate * TINY.paced_s)
    assert set(KEYS) <= set(spub)
    if result["skipped"]:
        pytest.skip(f"RabbitMQ modes skipped: {result['skipped']}")
    for mode in MODES:
        r = result["modes"][mode]
        assert set(KEYS) <= set(r), mode
        assert r["delivered_ratio"] == 1.0, mode
        assert r["latency_p99_ms"] >= r["latency_p50_ms"] > 0, mode
        assert r["max_tokens_per_s"] > 0, mode
    assert result["modes"]["rabbitmq_queue_per_conn"]["queues"] == TINY.sessions
    assert result["modes"]["rabbitmq_topic"]["queues"] == TINY.relays
    assert result["modes"]["rabbitmq_queue_per_conn"]["queue_churn_per_s"] > 0
    assert "rabbitmq_topic" in markdown(result)


@pytest.mark.timeout(30)
async def test_raw_amqp_client_routes_each_publish_to_its_queue_once(amqp: str) -> None:
    await _broker_or_skip(amqp)
    consumer = await amqp_io.Amqp.connect(amqp)
    producer = await amqp_io.Amqp.connect(amqp)
    exchange = "tokenrelay.test.raw"
    try:
        ch = await consumer.open_channel()
        await consumer.declare_exchange(ch, exchange, "direct")
        q = await consumer.declare_queue(ch)
        await consumer.bind(ch, q, exchange, amqp_io.routing_key("a"))
        await consumer.consume(ch, q)
        consumer.record = True
        consumer.start_counting()
        pch = await producer.open_channel()
        for _ in range(50):
            producer.publish(pch, exchange, amqp_io.routing_key("a"))
            producer.publish(pch, exchange, amqp_io.routing_key("b"))  # bound to nothing
        await producer.drain()
        for _ in range(200):
            if consumer.received >= 50:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert consumer.received == 50
        assert len(consumer.latencies_ns) == 50
        assert min(consumer.latencies_ns) > 0
        await producer.delete_exchange(pch, exchange)
    finally:
        await consumer.close()
        await producer.close()


async def test_a_wrong_url_scheme_is_a_clear_error() -> None:
    with pytest.raises(amqp_io.AmqpError, match="only amqp://"):
        await amqp_io.Amqp.connect("http://127.0.0.1:5672/")
