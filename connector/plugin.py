"""The connector by name: a ``vllm.general_plugins`` entry point.

vLLM runs every function declared under ``[project.entry-points."vllm.general_plugins"]`` once in
each of its processes (API server, engine core, workers) before it reads ``--kv-transfer-config``.
:func:`register` adds ``KVPlugConnector`` to ``KVConnectorFactory``'s registry, so

    --kv-transfer-config '{"kv_connector": "KVPlugConnector", "kv_role": "kv_both"}'

works without ``kv_connector_module_path`` (which still works: vLLM then imports the module itself
and never looks at the registry).

The registry entry is lazy: only the factory module is imported here; ``kvplug.connector.connector``
(and everything it pulls in) is imported when an engine actually builds the connector.
"""

from __future__ import annotations

import logging

#: The name ``kv_connector`` takes, the module vLLM imports on first use, and the class in it.
CONNECTOR_NAME = "KVPlugConnector"
MODULE_PATH = "kvplug.connector.connector"
CLASS_NAME = "KVPlugConnector"

log = logging.getLogger(__name__)
_registered = False  # by this process


def register() -> bool:
    """Register ``KVPlugConnector`` with vLLM's connector factory; ``True`` if this call added it.

    Calling it again (vLLM loads plugins once per process, a user may also call it) is harmless;
    a different class already registered under the name is left alone, with a warning.
    """
    global _registered
    if _registered:
        return False
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError as exc:  # a vLLM without the V1 connector factory
        log.warning("kvplug: cannot register %s with vLLM (%s); use kv_connector_module_path "
                    "'kvplug.connector'", CONNECTOR_NAME, exc)
        return False
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, MODULE_PATH, CLASS_NAME)
    except ValueError:  # "already registered", and not by this module
        log.warning("kvplug: another connector is already registered with vLLM as %r; "
                    "kvplug's stays reachable with kv_connector_module_path 'kvplug.connector'",
                    CONNECTOR_NAME)
        return False
    _registered = True
    return True
