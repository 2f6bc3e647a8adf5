"""tests.deploy."""
