"""The fronts' read side on the relays: one folder per front (its pure wire, its
connection, its routes); Durable Streams is the front of :mod:`relay.durable`."""
