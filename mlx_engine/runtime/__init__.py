"""Running requests: the engine threads, continuous batching, the streams handed to the host."""
