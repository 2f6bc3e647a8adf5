"""The relay's fan-out: one subscription per session, any number of connections."""
