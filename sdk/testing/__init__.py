"""Test kit for backend authors: ``from kvplug.testing import BackendConformance``."""

from .conformance import BackendConformance, call_hook, fill_random, implements, make_key, tiers_of

__all__ = ["BackendConformance", "call_hook", "fill_random", "implements", "make_key", "tiers_of"]
