"""The scheduler's gRPC links to its backends: the engine core's ports over the network."""
