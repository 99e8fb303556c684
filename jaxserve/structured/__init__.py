"""Structured outputs on the host: grammars compiled by a backend library, one matcher per
request that follows its tokens, and each step's per-request token masks (docs/architecture.md).

No jax here: the runner receives a packed bitmask per sampling row (SchedulerOutput.token_masks)
and never sees a grammar. The library is imported only by its backend module.
"""
