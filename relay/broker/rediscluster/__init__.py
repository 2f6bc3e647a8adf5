"""Redis 7 Cluster: the production broker, and the producers' Redis I/O."""
