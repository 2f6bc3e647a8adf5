"""relay.edge.http."""
