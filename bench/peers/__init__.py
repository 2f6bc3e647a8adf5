"""The relay beside the peers users pick instead (Socket.IO's sharded adapter)."""
