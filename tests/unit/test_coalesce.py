"""Token coalescing: the pure flush rules, then the async pump with a fake publisher."""

from __future__ import annotations

import asyncio

import pytest

from relay.producer.coalesce import Batch, CoalescePolicy, Coalescer, TokenPump


def test_first_token_goes_out_at_once():
    c = Coalescer(CoalescePolicy(max_tokens=4, max_delay_s=0.05))
    b = c.push("Hel", 0.0)
    assert b == Batch("Hel", 1, (0.0,))


def test_first_token_may_wait_when_asked():
    c = Coalescer(CoalescePolicy(max_tokens=4, max_delay_s=0.05, first_immediate=False))
    assert c.push("Hel", 0.0) is None
    assert c.pending == 1


def test_flush_at_n_tokens():
    c = Coalescer(CoalescePolicy(max_tokens=3, max_delay_s=1.0))
    c.push("a", 0.0)
    assert c.push("b", 0.01) is None
    assert c.push("c", 0.02) is None
    b = c.push("d", 0.03)
    assert b is not None
    assert (b.text, b.count) == ("bcd", 3)
    assert b.waits == pytest.approx((0.02, 0.01, 0.0))


def test_flush_at_t_after_the_oldest_pending_token():
    c = Coalescer(CoalescePolicy(max_tokens=10, max_delay_s=0.05))
    c.push("a", 0.0)
    c.push("b", 0.10)
    c.push("c", 0.12)
    assert c.deadline() == pytest.approx(0.15)
    assert c.poll(0.149) is None
    b = c.poll(0.1501)
    assert b is not None
    assert (b.text, b.count) == ("bc", 2)
    assert c.deadline() is None
    assert c.poll(1.0) is None


def test_whichever_comes_first():
    c = Coalescer(CoalescePolicy(max_tokens=2, max_delay_s=0.05))
    c.push("a", 0.0)
    c.push("b", 0.0)
    assert c.push("c", 0.001) is not None  # count rule fires before the timer
    c.push("d", 0.002)
    assert c.poll(0.053) is not None  # timer fires with one pending


def test_flush_empties_and_max_tokens_one_disables_coalescing():
    c = Coalescer(CoalescePolicy(max_tokens=5, max_delay_s=1.0))
    c.push("a", 0.0)
    c.push("b", 0.1)
    tail = c.flush(0.2)
    assert tail is not None
    assert (tail.text, tail.count) == ("b", 1)
    assert tail.waits == pytest.approx((0.1,))
    assert c.flush(0.3) is None
    one = Coalescer(CoalescePolicy(max_tokens=1, max_delay_s=1.0, first_immediate=False))
    assert [one.push(x, 0.0) is not None for x in "abc"] == [True, True, True]


def test_zero_delay_flushes_every_token():
    c = Coalescer(CoalescePolicy(max_tokens=8, max_delay_s=0.0))
    assert all(c.push(x, 0.0) is not None for x in "abcd")


def test_counters_add_up():
    c = Coalescer(CoalescePolicy(max_tokens=3, max_delay_s=1.0))
    for i, x in enumerate("abcdefg"):
        c.push(x, i * 0.01)
    c.flush(1.0)
    assert c.tokens == 7
    assert c.flushes == 3  # a | bcd | efg; the final flush found nothing
    assert c.pending == 0


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"max_delay_s": -1.0}])
def test_policy_rejects_nonsense(bad):
    with pytest.raises(ValueError):
        CoalescePolicy(**bad)


async def test_pump_publish_error_propagates():
    async def publish(b: Batch) -> None:
        raise RuntimeError("fenced")

    pump = TokenPump(publish)
    task = asyncio.create_task(pump.run())
    pump.push("a")
    with pytest.raises(RuntimeError, match="fenced"):
        await asyncio.wait_for(task, 1)
