"""bench.load."""
