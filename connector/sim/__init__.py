"""A deterministic simulation of kvplug inside vLLM's scheduler (connector/sim/README.md:
the invariants and how each is checked): ``runtime`` (kvplug's threads under the simulation's
control, and whose time a wait is), ``oracle`` (the KV every slot must hold, the token it
samples), ``world`` (the engine, the events), ``runner`` (how the model runner calls a worker),
the invariants' checkers, each a part the world owns: ``checks`` (I1-I5), ``capacity`` (I6, I7),
``manage`` (I8, and the operator's events), ``clients`` (I9, I11), ``stalls`` (I10); ``faults``
(the injected faults), ``schedule`` (random schedules, runs, shrinking), ``controls`` (negative
controls)."""
