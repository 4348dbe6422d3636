"""Chunk KV as a request reads it: which stored entry each chunk of a prompt reads (`placement`), the entries by
key, found in the store or prefilled and stored (`cache`), the text an entry is cached after (`context`), and the
entries a full prefill computes for free (`capture`)."""
