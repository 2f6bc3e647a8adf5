"""The costs ``tokenrelay capacity`` uses without ``--from``: tokenrelay's per-participant
CPU per token from one committed run of the whole-path benchmark, labelled with its
command and date (written by ``tokenrelay capacity --from RUN.json --write-defaults LABEL``)."""

from __future__ import annotations

from tokenrelay.capacity.core import Costs

__all__ = ["COSTS"]

COSTS = Costs(
    producer_us=19.75,
    redis_masters_us=42.42,
    redis_replicas_us=13.88,
    relay_us=29.38,
    source=(
        "python -m bench.peers.pathcost --seed 1 --profile prof --json pathcost.json, "
        "2026-12-07, 2 cores, nothing else running (load 1.5 -> 1.3): producer and Redis "
        "from 1000x1_10000, relay from 1000x1_10000"
    ),
)
