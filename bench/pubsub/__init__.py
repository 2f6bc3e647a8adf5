"""bench.pubsub."""
