"""The vLLM demo and the random-weight test-model builder, in a room of their own.

Both drive or feed a real vLLM engine, and only ``connector/`` may import vLLM, so they live under
``kvplug.connector`` — but in this sub-package, away from the connector's runtime modules
(scheduler, worker, lookup), which never import them:

* :mod:`.run`   — ``python -m kvplug.connector.demo`` (``make demo``, ``kvplug demo``);
* :mod:`.model` — tiny local models (config + random weights, no download) for the demo, the
  tests and the benchmarks, each with a BPE tokenizer trained locally (:mod:`.tokenizer`);
* :mod:`.quiet` — keeps vLLM's logs in a file while the demo draws on the terminal.
"""
