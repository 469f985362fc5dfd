"""kvplug's vLLM connector: ``--kv-transfer-config '{"kv_connector": "KVPlugConnector",
"kv_connector_module_path": "kvplug.connector", "kv_role": "kv_both", ...}'``."""

from .connector import KVPlugConnector

__all__ = ["KVPlugConnector"]
