"""The storage tiers, against real files and real servers, no vLLM engine (marker ``backends``;
tests/README.md)."""
