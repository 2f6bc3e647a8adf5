"""The store: its port (port.py, streams.py; the edge's part in base.py) and two stores,
in memory (memory.py, memstore.py, memstreams.py) and on Redis Cluster (rediscluster/)."""
