"""Session-less gateway conversations keep their engine across workers: the engine of a
conversation is kept in the store under a digest of its routing key, which every worker
computes the same way (two workers' gateways on one store, in this process)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest

from relay.broker.memstore import MemoryStore
from worker.engines.client import EngineClient
from worker.fronts.base import Gateway, GatewayConfig
from worker.metrics import WorkerMetrics
from worker.routing.lease import EngineSpec
from worker.routing.router import Router

pytestmark = pytest.mark.integration

SPECS = [EngineSpec(id=f"e{i}", url=f"http://127.0.0.1:{9 + i}", cap=8) for i in range(2)]


@dataclass
class Req:
    system: str | None
    conversation: list[dict[str, str]]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def gateway(http: aiohttp.ClientSession, store: MemoryStore | None) -> Gateway:
    return Gateway(GatewayConfig(model="m"), Router(SPECS, policy="cost_aware"),
                   EngineClient(http), WorkerMetrics(), records=store)  # fmt: skip


@pytest.mark.parametrize("shared", [True, False])
async def test_a_short_conversation_keeps_its_engine_on_another_worker(
    http: aiohttp.ClientSession, shared: bool
) -> None:
    store = MemoryStore()
    first, second = gateway(http, store), gateway(http, store if shared else None)
    system = "You are a careful assistant. " * 30
    turn1 = [{"role": "user", "content": "hi"}]
    lease = await first.lease(Req(system, turn1))
    home = lease.engine.id
    lease.first_token()
    lease.release()
    # the second worker is busy on that engine with another conversation: without the
    # first worker's memory, the cheaper engine for it is the other one
    other = "e1" if home == "e0" else "e0"
    busy = second.router.route("another", avoid=other)
    assert busy.engine.id == home
    turn2 = [*turn1, {"role": "assistant", "content": "hello!"},
             {"role": "user", "content": "and?"}]  # fmt: skip
    again = await second.lease(Req(system, turn2))
    assert again.engine.id == (home if shared else other)
    again.release()
    busy.release()
