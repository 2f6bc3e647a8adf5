"""Tests without a server: pure cores, parsers, settings, the layout's rules."""
