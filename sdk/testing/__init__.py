"""Test kit for backend and policy authors: ``from kvplug.testing import BackendConformance``
(a storage tier) or ``PolicyConformance`` (an eviction or admission policy).

The deterministic simulation (``BackendSimulation``, ``simulate``: vLLM's real scheduler and
kvplug's connector around the backend, the invariants I1-I5) lives with the connector, since it
runs vLLM; it is imported from there only when asked for, so this kit needs no vLLM.
"""

from typing import Any

from .conformance import BackendConformance, call_hook, fill_random, implements, make_key, tiers_of
from .policies import PolicyConformance

_SIMULATION = ("BackendSimulation", "simulate", "explain", "replay_command")

__all__ = ["BackendConformance", "PolicyConformance", "call_hook", "fill_random", "implements",
           "make_key", "tiers_of", *_SIMULATION]


def __getattr__(name: str) -> Any:
    if name in _SIMULATION:
        from kvplug.connector.sim import api

        return getattr(api, name)
    raise AttributeError(f"module 'kvplug.testing' has no attribute {name!r}")
