"""Test-only: kvplug's connector that never loads the sliding-window groups' blocks, for the
control in test_connector_hma.py (a hit that restores only the full-attention layers must change
the output, or the exactness check there could pass without the window being loaded).

A test names this module as ``kv_connector_module_path``; vLLM imports it in every process, so
importing it monkeypatches the group load plan (connector/groups.py) of the worker.
"""

from __future__ import annotations

from typing import Any

import kvplug.connector.protocol.groups as _groups
from kvplug.connector import KVPlugConnector

__all__ = ["KVPlugConnector"]

_load_parts = _groups.load_parts


def _full_groups_only(layout: Any, tables: Any, chunk_hash: bytes, *args: Any) -> list:
    parts = _load_parts(layout, tables, chunk_hash, *args)
    keep = {_groups.group_hash(chunk_hash, g) for g in layout.full}
    kept = [p for p in parts if p.hash in keep]
    for i, p in enumerate(kept):  # the chunk's tokens still count once
        p.counts = i == 0
    return kept


_groups.load_parts = _full_groups_only
