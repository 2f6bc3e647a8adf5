"""tests.bench."""
