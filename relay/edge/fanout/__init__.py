"""relay.edge.fanout."""
