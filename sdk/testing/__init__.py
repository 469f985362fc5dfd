"""Test kit for backend authors: ``from kvplug.testing import BackendConformance``."""

from .conformance import BackendConformance, fill_random, make_key

__all__ = ["BackendConformance", "fill_random", "make_key"]
