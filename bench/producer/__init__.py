"""The producers measured: CPU per token of the Python API, the Node package and the
publisher layer under them (:mod:`bench.producer.cpu`), and a soak of the Node producer
feeding two relays with many viewers, every frame checked against the backlog
(:mod:`bench.producer.soak`)."""
