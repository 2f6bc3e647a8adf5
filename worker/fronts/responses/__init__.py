"""OpenAI's Responses API on the worker: a response is a turn of a session."""
