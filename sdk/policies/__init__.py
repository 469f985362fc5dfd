"""Eviction and admission policies: the reference ones and how a tier's config finds them.

The contract is :mod:`kvplug.policyspecs`; discovery and config validation are
:mod:`kvplug.policies.registry`; the reference policies (each declared under the
``kvplug.policies`` entry-point group in kvplug's pyproject.toml, as a third party declares its
own) are :mod:`.eviction` (``lru``, ``s3fifo``) and :mod:`.admission` (``always``, ``tinylfu``).
"""

from .admission import AlwaysAdmit, TinyLFUAdmission
from .eviction import LRUEviction, S3FIFOEviction
from .registry import (
    ENTRY_POINT_GROUP,
    PolicyConfig,
    build_policy,
    discover_policies,
    load_policy_class,
    validate_policy_class,
)

__all__ = [
    "ENTRY_POINT_GROUP", "AlwaysAdmit", "LRUEviction", "PolicyConfig", "S3FIFOEviction",
    "TinyLFUAdmission", "build_policy", "discover_policies", "load_policy_class",
    "validate_policy_class",
]
