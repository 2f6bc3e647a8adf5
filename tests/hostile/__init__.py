"""Hostile input: tokens, connections, malformed requests, fuzzing; the error bodies."""
