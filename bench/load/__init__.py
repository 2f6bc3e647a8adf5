"""The load test, its measuring viewers, the accounting against Redis; closed-loop latency."""
