"""Fuzzing the parsers that read hostile input."""
