"""One bound for every producer's death (relay.protocol.keys.PRODUCER_LOST_S): each
producer's turn lock defaults to LOCK_TTL_S and refuses one past MAX_LOCK_TTL_S, the
worker (its config), relay.producer (its constructor) and the TypeScript producer (its
own constants, read from its source: checked against the Python ones here, run in
clients/producer's tests)."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from relay.broker.memstore import MemoryStore
from relay.producer import Producer
from relay.protocol.keys import LOCK_TTL_S, MAX_LOCK_TTL_S, PRODUCER_LOST_S
from relay.service.settings import ConfigError
from worker.config import WorkerConfig

TS = Path(__file__).resolve().parents[2] / "clients" / "producer" / "src" / "producer.js"


def test_the_lock_and_the_reaper_fit_the_bound() -> None:
    reaper_tick_s, round_trips_s = 1.0, 1.0  # the relays' reaper looks once a second
    assert LOCK_TTL_S <= MAX_LOCK_TTL_S
    assert MAX_LOCK_TTL_S + reaper_tick_s + round_trips_s <= PRODUCER_LOST_S


def test_the_python_producer_keeps_the_bound() -> None:
    store = MemoryStore()
    assert Producer(store).lock_ttl_ms == LOCK_TTL_S * 1000
    assert Producer(store, lock_ttl_s=MAX_LOCK_TTL_S).lock_ttl_ms == MAX_LOCK_TTL_S * 1000
    for bad in (15.0, 0.0, float("nan")):
        with pytest.raises(ValueError, match="lock_ttl_s must be in"):
            Producer(store, lock_ttl_s=bad)


def test_the_worker_keeps_the_bound() -> None:
    cfg = WorkerConfig(redis_url="redis://127.0.0.1:7000", engine_urls=("http://e:1",),
                       insecure_no_auth=True)  # fmt: skip
    assert cfg.validate().lock_ttl_s == LOCK_TTL_S
    with pytest.raises(ConfigError, match="turn lock's TTL"):
        msgspec.structs.replace(cfg, lock_ttl_s=15.0).validate()


def test_the_typescript_producer_states_the_same_figures() -> None:
    src = TS.read_text()

    def const(name: str) -> float:
        m = re.search(rf"export const {name} = ([0-9_]+);", src)
        assert m is not None, name
        return int(m.group(1).replace("_", "")) / 1000

    assert const("LOCK_TTL_MS") == LOCK_TTL_S
    assert const("MAX_LOCK_TTL_MS") == MAX_LOCK_TTL_S
    assert const("PRODUCER_LOST_MS") == PRODUCER_LOST_S
