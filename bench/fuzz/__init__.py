"""bench.fuzz.run."""
