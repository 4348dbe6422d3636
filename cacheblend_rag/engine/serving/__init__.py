"""Serving many requests: one queue and its server (`scheduler`), its jobs and what a turn does to them (`jobs`),
decode steps batched across requests (`batch_decode`, `decode_slots`, `slots`, `graphs`), a request's token loop and
the streams callers read (`decoding`, `tokens`), the chunks cold requests skipped, stored after their answers
(`deferred_fills`), threads' CPU pools (`thread_pools`), forks (`forking`) and stopping the workers at exit
(`shutdown`)."""
