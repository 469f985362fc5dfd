"""Test-only: kvplug's connector with a deliberately corrupted load path, for the exactness
control in test_connector_engine.py.

A test names this module as ``kv_connector_module_path``; vLLM imports it in the engine-core and in
every worker process, so importing it monkeypatches the bulk scatter of the load path (kvplug.connector.worker.load):
the pages of every loaded chunk are permuted (blocks in reversed order) before they reach blocks.
"""

from __future__ import annotations

from typing import Any

import kvplug.connector.worker.load as _load
from kvplug.connector import KVPlugConnector

__all__ = ["KVPlugConnector", "permute_pages"]

_scatter_many = _load.scatter_many


def permute_pages(src: Any) -> Any:
    """Swap the blocks of a chunk's pages (reversed order; bytes within a page if only one)."""
    return src.flip(1) if src.shape[1] > 1 else src.flip(2)


def _permuted_scatter_many(kv: Any, jobs: Any) -> None:
    _scatter_many(kv, [(ids, permute_pages(pages)) for ids, pages in jobs])


_load.scatter_many = _permuted_scatter_many
