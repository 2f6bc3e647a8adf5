"""The edge's aiohttp app: routes, admission, the stream handlers, stream limits."""
