"""bench.routing."""
