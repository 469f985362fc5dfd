"""Test kit for backend and policy authors: ``from kvplug.testing import BackendConformance``
(a storage tier) or ``PolicyConformance`` (an eviction or admission policy)."""

from .conformance import BackendConformance, call_hook, fill_random, implements, make_key, tiers_of
from .policies import PolicyConformance

__all__ = ["BackendConformance", "PolicyConformance", "call_hook", "fill_random", "implements",
           "make_key", "tiers_of"]
