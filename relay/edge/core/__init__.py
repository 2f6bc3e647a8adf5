"""relay.edge.core."""
