"""Parts the remote tiers share (one place for each rule): the circuit breaker
(:mod:`.breaker`), the lookup caches and capacity index (:mod:`.index`) — fsspec, resp and
mooncake — and the tier over a key-value store (:mod:`.value_tier`, :mod:`.value_writer`,
:mod:`.value_io`) — resp and mooncake. Credential scrubbing is :mod:`kvplug.redact` (the CLI and
the core's start-up errors use the same rule)."""
