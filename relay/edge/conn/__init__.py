"""One object per client connection, by transport (SSE, WebSocket, UI stream, in-process)."""
