"""Test-only: kvplug's connector whose loads leave the speculative drafter's KV layers wrong, for
the acceptance control in test_connector_engine_spec.py.

A test names this module as ``kv_connector_module_path``; vLLM imports it in the engine's
processes, so importing it monkeypatches the bulk scatter of the load path (kvplug.connector.worker.load):
every loaded chunk reaches the blocks with the pages of the drafter's layers (vLLM names them
``draft_model.*``; an EAGLE head's layers are numbered after the target's) zeroed. The target's
layers load right, so the output is unchanged; only the drafts (and so acceptance) can tell.
"""

from __future__ import annotations

import re
from typing import Any

import kvplug.connector.worker.load as _load
from kvplug.connector import KVPlugConnector

__all__ = ["KVPlugConnector"]

TARGET_LAYERS = 4  # the tiny test model's
_scatter_many = _load.scatter_many


def is_draft_layer(name: str) -> bool:
    m = re.search(r"layers\.(\d+)\.", name)
    return "draft" in name or (m is not None and int(m.group(1)) >= TARGET_LAYERS)


def _poisoned_scatter_many(kv: Any, jobs: Any) -> None:
    bad = [i for i, n in enumerate(kv.layer_names) if is_draft_layer(n)]
    assert bad, f"no drafter layer among {kv.layer_names}"
    out = []
    for ids, pages in jobs:
        pages = pages.clone()
        pages[bad] = 0
        out.append((ids, pages))
    _scatter_many(kv, out)


_load.scatter_many = _poisoned_scatter_many
