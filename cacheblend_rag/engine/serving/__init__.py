"""Serving many requests: one queue and its server (`scheduler`, `jobs`, `job_steps`), decode steps batched across
requests (`batch_decode`), a request's token loop and the streams callers read (`decoding`, `tokens`), the chunks
cold requests skipped, stored after their answers (`deferred_fills`), threads' CPU pools (`thread_pools`) and
stopping the workers at exit (`shutdown`)."""
