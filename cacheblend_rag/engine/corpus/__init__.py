"""A corpus's chunk KV ahead of requests: `precompute` (`Corpus`, the part the engine holds as `engine.corpus`) and
grouped precompute (`groups`: full prefills of groups of similar chunks)."""
