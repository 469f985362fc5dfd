"""Parts the remote tiers share (one place for each rule): the circuit breaker
(:mod:`.breaker`), the lookup caches and capacity index (:mod:`.index`) and credential scrubbing
(:mod:`.redact`)."""
