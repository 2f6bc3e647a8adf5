"""The Vercel AI SDK's chat POST on the worker (its streams: the relays')."""
