"""bench.relay."""
