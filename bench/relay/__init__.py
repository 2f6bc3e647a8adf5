"""One relay process: throughput, latency, memory, its own code per frame, its anatomy."""
