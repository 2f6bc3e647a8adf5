"""One object per client connection, by transport (SSE, WebSocket, in-process), and what
a front's one-turn stream shares (relay/fronts/ holds the fronts' own connections)."""
