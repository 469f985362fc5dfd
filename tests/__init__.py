"""kvplug's test suite, by layer (tests/README.md says which folder holds what)."""
