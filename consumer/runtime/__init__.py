"""The consumer runtime: leadership, wake-ups, batching and shutdown. It knows nothing of HTTP."""
