"""The fault suite: break one piece of a running stack while streams flow, and count."""
