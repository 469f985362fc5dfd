"""kvplug's Prometheus metrics on a real vLLM OpenAI server's ``/metrics``.

One ``kvplug serve`` (RAM tier in front of a disk tier, vLLM's prefix cache off) gets a cold and a
warm request; its ``/metrics`` must then hold kvplug's counters with the values the requests imply
(hit tokens = the warm request's ``cached_tokens``, bytes stored in both tiers, one load), and
vLLM's own cache-hit-by-source counter must put those tokens under ``host`` (the RAM tier). The
control is plain vLLM on the same model: no ``kvplug`` metric at all.
"""

from __future__ import annotations

import time
import urllib.request

import pytest

from tests.support.server_helpers import TINY_SERVER_ARGS, free_port, kvplug_cli, running_server, vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]
CHUNK = 256


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """``/metrics`` as {(sample name, sorted labels without model_name/engine): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("model_name", "engine")))
            out[(s.name, labels)] = s.value
    return out


def kvplug_samples(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if "kvplug" in k[0]}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvplug.connector.demo.model import make_model

    return str(make_model("tiny", root=tmp_path_factory.getbasetemp() / "models"))


def _two_requests(url: str, model: str) -> tuple[int, int]:
    """A cold and a warm request of the same ~2.7k-token prompt: (prompt tokens, cached)."""
    from kvplug.connector.demo.tokenizer import sentences
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=300)
    text = " ".join(sentences(7, 150))
    cold = client.completions.create(model=model, prompt=text, max_tokens=2, temperature=0)
    warm = client.completions.create(model=model, prompt=text, max_tokens=2, temperature=0)
    return cold.usage.prompt_tokens, warm.usage.prompt_tokens_details.cached_tokens


def test_metrics_of_a_cold_and_a_warm_request(tmp_path_factory, model):
    base = tmp_path_factory.mktemp("prom")
    cfg = base / "kvplug.yaml"
    cfg.write_text("tiers:\n  - backend: local_cpu\n    options: {capacity: 256MiB}\n"
                   f"  - backend: posix\n    options: {{path: {base / 'chunks'}, "
                   "capacity: 1GiB}\n")
    port = free_port()
    argv = kvplug_cli("serve", model, "--kvplug-config", str(cfg), "--port", str(port),
                      *TINY_SERVER_ARGS)
    with running_server(argv, base, port) as (url, _):
        n, cached = _two_requests(url, model)
        assert 0 < cached < n
        hit = ("vllm:kvplug_hit_tokens_total", (("tier", "local_cpu"),))
        deadline = time.monotonic() + 120  # stats reach the front end with the engine's outputs
        while (m := scrape(url)).get(hit) != cached and time.monotonic() < deadline:
            time.sleep(0.2)
    ram, disk = (("tier", "local_cpu"),), (("tier", "posix"),)
    assert m[hit] == cached  # every hit token came from the RAM tier
    assert ("vllm:kvplug_hit_tokens_total", disk) not in m
    assert m[("vllm:kvplug_lookups_total", ())] == 2
    assert m[("vllm:kvplug_lookup_hit_tokens_total", ())] == cached
    stored_tokens = m[("vllm:kvplug_stored_tokens_total", ())]
    assert cached <= stored_tokens < n
    # the same chunks went to both tiers (the warm hit came from RAM: nothing was promoted)
    stored = m[("vllm:kvplug_stored_bytes_total", ram)]
    assert stored > 0 and m[("vllm:kvplug_stored_bytes_total", disk)] == stored
    assert m[("vllm:kvplug_tier_puts_total", ram)] == -(-stored_tokens // CHUNK)
    # loaded bytes: the cached tokens' share of what was stored (bytes are per block)
    assert m[("vllm:kvplug_loaded_bytes_total", ram)] * stored_tokens == stored * cached
    assert m[("vllm:kvplug_load_seconds_count", ram)] == 1
    assert m[("vllm:kvplug_load_errors_total", ())] == 0
    assert not any(k[0].startswith(("vllm:kvplug_evictions", "vllm:kvplug_corrupt",
                                    "vllm:kvplug_tier_faults", "vllm:kvplug_dropped"))
                   and v for k, v in m.items())
    # vLLM's own counters: the external hit, split by source (the RAM tier is "host")
    assert m[("vllm:external_prefix_cache_hits_total", ())] == cached
    assert m[("vllm:prompt_tokens_cached_by_source_total", (("source", "host"),))] == cached
    assert m[("vllm:prompt_tokens_cached_by_source_total",
              (("source", "external_unspecified"),))] == 0


def test_control_plain_vllm_has_no_kvplug_metrics(tmp_path_factory, model):
    base = tmp_path_factory.mktemp("prom-control")
    port = free_port()
    with running_server(vllm_server(model, "--port", str(port), *TINY_SERVER_ARGS),
                        base, port) as (url, _):
        n, cached = _two_requests(url, model)
        m = scrape(url)
    assert n > 4 * CHUNK and cached == 0
    assert m[("vllm:prompt_tokens_total", ())] == 2 * n  # the scrape itself works
    assert kvplug_samples(m) == {}
