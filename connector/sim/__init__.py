"""A deterministic simulation of kvplug inside vLLM's scheduler (see docs/architecture.md,
"Protocol invariants"): ``runtime`` (kvplug's threads under the simulation's control),
``oracle`` (the KV every slot must hold), ``world`` (the engine, the events, the invariants),
``schedule`` (random schedules, runs, shrinking), ``controls`` (negative controls)."""
