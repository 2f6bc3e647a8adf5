"""Compatibility shim: the routing simulator moved to :mod:`bench.routing_sim`.

``python -m bench.router_sim`` runs ``python -m bench.routing_sim`` (same flags)."""

from bench.routing_sim import POLICIES, SimConfig, main, run, run_all

__all__ = ["POLICIES", "SimConfig", "main", "run", "run_all"]

if __name__ == "__main__":
    main()
