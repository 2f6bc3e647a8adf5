"""The benchmarks' own tests: each runs small and is checked against its source of truth."""
