"""One part of kvplug at a time, no vLLM engine (marker ``unit``; tests/README.md)."""
