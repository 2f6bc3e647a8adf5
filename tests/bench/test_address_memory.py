"""``bench.storage.address_memory``'s arithmetic, without a stack: the ceiling of one
session is its byte budgets at the overhead measured, plus an hour of idempotency
records, and a session that stopped at the frame bound says so."""

from __future__ import annotations

from bench.storage.address_memory import HISTORY_MAX_BYTES, _project
from relay.protocol.keys import BACKLOG_MAX_BYTES


def _session(**kw: int) -> dict[str, int]:
    base = {"log": 0, "meta": 100, "hist": 0, "state": 100, "idem": 0, "other": 0,
            "frame_bytes": 0, "frames": 0, "history_bytes": 0, "idem_records": 0}  # fmt: skip
    return {**base, **kw}


def test_the_ceiling_is_the_budgets_at_the_overhead_measured() -> None:
    full = _session(log=2_600_000, frame_bytes=2_000_000, frames=9_900, hist=1_200_000,
                    history_bytes=1_000_000, idem=3_600, idem_records=10)  # fmt: skip
    small = _session(log=130_000, frame_bytes=100_000, frames=500, hist=110_000,
                     history_bytes=100_000, idem=720, idem_records=2)  # fmt: skip
    got = _project([full, small])
    assert got["log_bytes_per_frame_byte"] == 1.3
    assert got["hist_bytes_per_history_byte"] == 1.2
    assert got["idem_bytes_per_record"] == 360
    assert got["idem_records_per_session_at_most"] == 1800
    want = int(1.3 * BACKLOG_MAX_BYTES + 1.2 * HISTORY_MAX_BYTES + 360 * 1800 + 200)
    assert abs(got["per_session_worst_bytes"] - want) <= 1
    assert got["per_session_measured_bytes"] == 2_600_000 + 1_200_000 + 3_600 + 200
    assert got["measured_session_stopped_at"] == "maxlen"
    assert got["history_full"] is True  # 1,000,000 bytes: within 10 % of its 1 MiB
