"""The Durable Streams protocol on Redis Cluster (docs/DURABLE.md)."""
