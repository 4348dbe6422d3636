"""A prompt's KV cache in one of the four modes: the prefill (`prefiller`), over the stored KV gathered for it
(`gather`), with the tokens to recompute planned by pure functions (`planning`) and stored layers read ahead of the
fusor (`prefetch`); one prefill's state travels as a `PrefillRun` (`state`)."""
