"""zerokl.services.engine: the batch-invariant inference engine (continuous batching, paged KV, prefix cache)."""
