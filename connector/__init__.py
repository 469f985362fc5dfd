"""kvplug's vLLM connector: ``--kv-transfer-config '{"kv_connector": "KVPlugConnector",
"kv_connector_module_path": "kvplug.connector", "kv_role": "kv_both", ...}'``.

``KVPlugConnector`` is imported on first use, so ``kvplug.connector.protocol.config`` (read by every
kvplug process that loads a config) does not pull in vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .connector import KVPlugConnector

__all__ = ["KVPlugConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVPlugConnector":
        from .connector import KVPlugConnector

        return KVPlugConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
