"""Did a drill's fault take effect? Pure judgement of the evidence a drill recorded.

A drill that kills a master which was not one, moves a slot that ends where it
started, or stalls a node nobody waited on proves nothing: its zeros would read as
"survived the fault". Each fault names the evidence that it happened; :func:`judge`
says whether that evidence holds. :mod:`bench.faults.drills` records the evidence during the
drill, calls :func:`judge` on the report and fails a drill whose fault did not take
effect.

Order of use: ``ok, evidence = judge(name, report)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

__all__ = ["EVIDENCE", "MUST_BE_ZERO", "judge"]

# what every drill's report must show as 0 (beside took_effect: true)
MUST_BE_ZERO: Final = (
    "lost",
    "duplicated",
    "out_of_order",
    "content_mismatches",
    "unended_turns",
    "viewers_behind",
    "stalled_viewers",
    "lost_writes",
)

Check = Callable[[Mapping[str, Any]], bool]


def _get(r: Mapping[str, Any], k: str, default: Any = 0) -> Any:
    v = r.get(k)
    return default if v is None else v


# fault -> (the report keys that are its evidence, the check on them)
EVIDENCE: Final[dict[str, tuple[tuple[str, ...], Check]]] = {
    "relay_kill": (
        ("killed_relay_exit", "reconnects"),
        lambda r: _get(r, "killed_relay_exit", None) is not None and _get(r, "reconnects") >= 1,
    ),
    "master_kill": (
        ("slot_master_before", "slot_master_after"),
        lambda r: (
            bool(r.get("slot_master_after"))
            and r.get("slot_master_after") != r.get("slot_master_before")
        ),
    ),
    "reshard": (
        ("slot_owner_before", "slot_owner_after", "slots_moved", "keys_moved"),
        lambda r: (
            _get(r, "keys_moved") > 0
            and _get(r, "slots_moved") > 0
            and bool(r.get("slot_owner_after"))
            and all(
                a != b
                for a, b in zip(
                    _get(r, "slot_owner_before", []), _get(r, "slot_owner_after", []), strict=True
                )
            )
        ),
    ),
    "engine_kill": (
        ("killed_engine_leases", "error_frames"),
        lambda r: _get(r, "killed_engine_leases") > 0 and _get(r, "error_frames") > 0,
    ),
    "worker_kill": (
        ("killed_leases", "error_frames"),
        lambda r: _get(r, "killed_leases") > 0 and _get(r, "error_frames") > 0,
    ),
    "relay_stall_buffer": (("dropped_by_redis",), lambda r: r.get("dropped_by_redis") is True),
    "redis_stall": (
        ("stall_seen_ms", "stall_s"),
        # a PING sent to the paused master waited (most of) the pause for its answer
        lambda r: _get(r, "stall_seen_ms") >= 0.6 * 1000 * _get(r, "stall_s"),
    ),
    "partition": (
        ("partition_ping", "healed_ping", "partition_s"),
        lambda r: r.get("partition_ping") == "no answer" and r.get("healed_ping") == "PONG",
    ),
    "session_expiry": (
        ("gen_before", "gen_after", "first_offset_after", "resets_seen", "viewers_of_it"),
        lambda r: (
            bool(r.get("gen_after"))
            and r.get("gen_after") != r.get("gen_before")
            and r.get("first_offset_after") == 1
            and _get(r, "resets_seen") >= _get(r, "viewers_of_it") > 0
        ),
    ),
}


def judge(name: str, report: Mapping[str, Any]) -> tuple[bool, dict[str, Any]]:
    """``(took_effect, evidence)``: the evidence keys of ``name`` as the report has them."""
    keys, check = EVIDENCE[name]
    evidence = {k: report.get(k) for k in keys}
    try:
        ok = bool(check(report))
    except (TypeError, ValueError):  # evidence missing or malformed: not proven
        ok = False
    return ok, evidence
