"""The costs ``tokenrelay capacity`` uses without ``--from``: tokenrelay's per-participant
CPU per token from one committed run of the whole-path benchmark, labelled with its
command and date (written by ``tokenrelay capacity --from RUN.json --write-defaults LABEL``)."""

from __future__ import annotations

from bench.capacity.core import Costs

__all__ = ["COSTS"]

COSTS = Costs(
    producer_us=23.53,
    redis_masters_us=53.68,
    redis_replicas_us=17.31,
    relay_us=36.12,
    source=(
        "python -m bench.peers.pathcost --seed 1 --profile prof --json pathcost.json, "
        "2026-12-03, 2 cores, nothing else running (load 0.4 -> 2.0): producer and Redis "
        "from 1000x1_10000, relay from 1000x1_10000"
    ),
)
