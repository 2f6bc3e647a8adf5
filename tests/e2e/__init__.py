"""tests.e2e."""
