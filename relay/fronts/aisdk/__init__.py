"""The Vercel AI SDK's UI message stream, read from a relay (the chat POST: the worker's)."""
