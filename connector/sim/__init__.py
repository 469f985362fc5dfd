"""A deterministic simulation of kvplug inside vLLM's scheduler (connector/sim/README.md:
the invariants and how each is checked): ``runtime`` (kvplug's threads under the simulation's
control, and whose time a wait is), ``oracle`` (the KV every slot must hold, the token it
samples), ``world`` (the engine, the events), ``runner`` (how the model runner calls a worker),
the invariants in ``checks``, ``stalls`` (I10) and ``clients`` (I9, I11), ``schedule`` (random
schedules, runs, shrinking), ``controls`` (negative controls)."""
