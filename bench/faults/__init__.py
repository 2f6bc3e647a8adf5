"""bench.faults.drills."""
