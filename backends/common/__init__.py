"""Parts the remote tiers share (one place for each rule): the circuit breaker
(:mod:`.breaker`), the lookup caches and capacity index (:mod:`.index`), credential scrubbing
(:mod:`.redact`) — fsspec, resp and mooncake — and the tier over a key-value store
(:mod:`.value_tier`, :mod:`.value_writer`, :mod:`.value_io`) — resp and mooncake."""
