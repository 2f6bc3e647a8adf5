"""Compatibility shim: the routing simulator is :mod:`bench.routing_sim`.

``python -m bench.router_sim`` runs ``python -m bench.routing_sim`` (same flags)."""

from bench.routing_sim import POLICIES, main, run_all

__all__ = ["POLICIES", "main", "run_all"]

if __name__ == "__main__":
    main()
