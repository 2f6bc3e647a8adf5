"""OpenAI's Responses API, read from a relay: a response's events resumed (the rest: the
worker's)."""
