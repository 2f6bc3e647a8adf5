"""bench.peers."""
