"""The fronts' write side on the workers: one folder per front (its pure request wire, its
routes), on the gateway's shared configuration (:mod:`worker.fronts.base`)."""
