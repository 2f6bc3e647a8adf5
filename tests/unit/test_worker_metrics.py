"""The worker's engine gauges never publish an engine's address: an engine named only by
its URL (id ``host:port``) is labelled by a digest of the id, the same on every worker;
a named engine keeps its name."""

from __future__ import annotations

import re

from worker.metrics import WorkerMetrics, engine_label
from worker.routing.control import parse_engine_arg
from worker.routing.router import Router


def test_engines_named_by_their_address_are_labelled_by_a_digest() -> None:
    router = Router([parse_engine_arg("http://10.1.2.3:8000/v1", 4),
                     parse_engine_arg("http://[fd00::7]:8001", 4),
                     parse_engine_arg("gpu-a=http://10.1.2.4:8000", 4)])  # fmt: skip
    m = WorkerMetrics()
    m.bind_router(router)
    text = m.render().decode()
    assert "10.1.2.3" not in text
    assert "fd00" not in text
    assert "10.1.2.4" not in text
    assert 'tokenrelay_worker_engine_cap{engine="gpu-a"} 4.0' in text
    labels = set(re.findall(r'engine_cap\{engine="(engine-[0-9a-f]{8})"\}', text))
    assert labels == {engine_label("10.1.2.3:8000"), engine_label("fd00::7:8001")}
    assert engine_label("10.1.2.3:8000") == engine_label("10.1.2.3:8000")  # every worker
    assert engine_label("gpu-a") == "gpu-a"
