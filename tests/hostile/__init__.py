"""tests.hostile."""
