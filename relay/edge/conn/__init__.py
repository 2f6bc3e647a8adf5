"""relay.edge.conn."""
