"""What Redis costs: PUBLISH vs SPUBLISH, coalescing, a message queue beside Pub/Sub."""
