"""The edge's pure cores: the resume merge, one screen's queue, the client's WebSocket frames."""
