"""Tests against the suite's real Redis Cluster: relay, worker, publisher, subscriber."""
