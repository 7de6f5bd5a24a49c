"""Batching, the device thread, warmup profiling and the engine that ties them together."""
