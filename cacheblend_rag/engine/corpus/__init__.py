"""A corpus's chunk KV ahead of requests: `precompute` (the engine's methods over a corpus) and grouped precompute
(`groups`: full prefills of groups of similar chunks)."""
