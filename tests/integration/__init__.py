"""tests.integration."""
