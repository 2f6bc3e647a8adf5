"""The routing simulator, its engine model and workloads, and the router's micro-benchmark."""
