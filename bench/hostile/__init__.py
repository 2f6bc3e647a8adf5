"""Hostile benchmarks: attacks measured against a running relay (slow_clients.py)."""
