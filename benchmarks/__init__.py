"""kvplug's benchmarks, one module each: run from the repository root as
``python -m benchmarks.NAME`` (they import the suite's servers and harnesses from
``tests.support``). Their figures: benchmarks/RESULTS.md."""
