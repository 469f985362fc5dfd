"""The deterministic simulation of vLLM's scheduler around kvplug (marker ``sim``; tests/README.md)."""
