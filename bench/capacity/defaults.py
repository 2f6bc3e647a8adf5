"""The costs ``tokenrelay capacity`` uses without ``--from``: tokenrelay's per-participant
CPU per token from one committed run of the whole-path benchmark, labelled with its
command and date (written by ``tokenrelay capacity --from RUN.json --write-defaults LABEL``)."""

from __future__ import annotations

from bench.capacity.core import Costs

__all__ = ["COSTS"]

COSTS = Costs(
    producer_us=14.74,
    redis_masters_us=29.94,
    redis_replicas_us=8.69,
    relay_us=17.33,
    source=(
        "python -m bench.peers.pathcost --quick, 2026-12-02, 2 shared cores, load "
        "0.4-0.6: producer and Redis from 1000x1_10000, relay from 1000x1_10000"
    ),
)
