"""kvplug's management API, ``kvplug cache``, ``kvplug warm`` and the deploy/ files on one real
``kvplug serve`` (the tiny model, RAM in front of a posix directory, eviction and admission
policies set on them, vLLM's prefix cache off so every cached token a request reports was loaded
by kvplug, ``--api-key`` set).

What the API says is checked against what the engine does: a lookup's tokens against the
``cached_tokens`` the same prompt then reports; a clear against the files left on disk, a lookup
right after and a request that then loads nothing. One server serves every test (in file order).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support.server_helpers import TINY_SERVER_ARGS, free_port, kvplug_cli, running_server

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]
KEY = "test-key-" + "5" * 8
CHUNK = 256  # kvplug's default chunk_size
BLOCK = 128  # TINY_SERVER_ARGS' --block-size
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from kvplug.connector.demo.model import make_model

    base = tmp_path_factory.mktemp("manage")
    model = make_model("tiny", root=tmp_path_factory.getbasetemp() / "models")
    store = base / "chunks"
    cfg = base / "kvplug.yaml"
    # policies set (ones that leave these tests' stores and hits as without them): status
    # reports them by name and settings
    cfg.write_text("tiers:\n  - backend: local_cpu\n    options: {capacity: 256MiB}\n"
                   "    eviction: s3fifo\n"
                   f"  - backend: posix\n    options: {{path: {store}, capacity: 1GiB}}\n"
                   "    admission: {policy: always}\n")
    port = free_port()
    argv = kvplug_cli("serve", str(model), "--kvplug-config", str(cfg), "--port", str(port),
                      "--api-key", KEY, *TINY_SERVER_ARGS)
    with running_server(argv, base, port) as (url, _):
        yield url, str(model), store


def http(url: str, path: str, body: dict | None = None, key: str | None = KEY
         ) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, method="POST" if body is not None else "GET",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def prompt_text(seed: int, n: int = 150) -> str:
    from kvplug.connector.demo.tokenizer import sentences

    return " ".join(sentences(seed, n))


def complete(url: str, model: str, prompt: str, **extra) -> int:
    """One prefill; the prompt tokens it loaded (``cached_tokens``)."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key=KEY, timeout=300)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                    extra_body=extra or None)
    return out.usage.prompt_tokens_details.cached_tokens or 0


def lookup(url: str, **body) -> dict:
    status, out = http(url, "/kvplug/v1/lookup", body)
    assert status == 200, out
    return out


def disk_files(store: Path) -> int:
    return sum(1 for p in store.rglob("*") if p.is_file() and not p.name.startswith("."))


def test_serve_warm_request_reports_cached_tokens_from_kvplug(server):
    """First on the server (nothing stored yet): a cold request stores, the same prompt again
    loads every block but the last from kvplug (vLLM's prefix cache is off)."""
    from kvplug.connector.demo.tokenizer import sentences
    from openai import OpenAI

    url, model, store = server
    log = store.parent / "server.log"  # tests.support.server_helpers.running_server's
    client = OpenAI(base_url=url + "/v1", api_key=KEY, timeout=300)
    text = " ".join(sentences(7, 150))  # ~2.7k tokens of the tokenizer's own made-up language
    cold = client.completions.create(model=model, prompt=text, max_tokens=4, temperature=0)
    n = cold.usage.prompt_tokens
    assert n > 4 * CHUNK and cold.usage.completion_tokens == 4
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    warm = client.completions.create(model=model, prompt=text, max_tokens=4, temperature=0)
    cached = warm.usage.prompt_tokens_details.cached_tokens
    # vLLM's prefix cache is off: these came from kvplug, at vLLM's block granularity (every
    # block but the one holding the last token, which vLLM always computes)
    assert cached == (n - 1) // BLOCK * BLOCK
    assert warm.usage.prompt_tokens == n
    # the chat endpoint works too (the model ships a tokenizer with a chat template)
    chat = client.chat.completions.create(model=model, max_tokens=3, temperature=0,
                                          messages=[{"role": "user", "content": "Karito mesa?"}])
    assert chat.usage.completion_tokens == 3
    deadline = time.monotonic() + 120  # the posix tier writes on its own threads
    while len(list(store.rglob("*.safetensors"))) < n // CHUNK and time.monotonic() < deadline:
        time.sleep(0.2)
    # every full chunk, plus the block-aligned partial chunks that make hits block-granular
    assert len(list(store.rglob("*.safetensors"))) >= n // CHUNK
    text_log = log.read_text()
    assert "kv_connector_module_path=None" in text_log and "Traceback" not in text_log


def test_routes_need_the_key_and_are_in_the_openapi_schema(server):
    url, _, _ = server
    for path, body in (("/kvplug/v1/status", None), ("/kvplug/v1/lookup", {"prompt": "x"}),
                       ("/kvplug/v1/clear", {"scope": "all"}), ("/kvplug/v1/pin", {"prompt": "x"}),
                       ("/kvplug/v1/unpin", {"prompt": "x"})):
        for key in (None, "wrong"):
            status, _ = http(url, path, body, key=key)
            assert status == 401, f"{path} answered {status} with key {key!r}"
    with urllib.request.urlopen(url + "/openapi.json", timeout=60) as r:
        schema = json.loads(r.read())
    for path, method in (("/kvplug/v1/lookup", "post"), ("/kvplug/v1/clear", "post"),
                         ("/kvplug/v1/pin", "post"), ("/kvplug/v1/unpin", "post"),
                         ("/kvplug/v1/status", "get")):
        assert method in schema["paths"][path], path
    assert "LookupResponse" in schema["components"]["schemas"]
    status, out = http(url, "/kvplug/v1/lookup", {"prompt": "x", "token_ids": [1]})
    assert status == 400 and "token_ids" in json.dumps(out)  # vLLM answers 400 to a bad body


def test_lookup_says_what_the_next_request_loads(server):
    url, model, _ = server
    text = prompt_text(11)
    cold = lookup(url, prompt=text)
    assert cold["tokens"] == 0 and all(t["held"] == 0 for t in cold["tiers"].values())
    assert complete(url, model, text) == 0
    after = lookup(url, prompt=text)
    hit = after["tokens"]
    assert hit > 0 and hit % after["block_size"] == 0
    assert {n: t["held"] for n, t in after["tiers"].items()} == {"local_cpu": hit, "posix": hit}
    assert after["tiers"]["local_cpu"]["served"] == hit  # RAM first
    ids = http(url, "/tokenize", {"model": model, "prompt": text})[1]["tokens"]
    assert lookup(url, token_ids=ids)["tokens"] == hit
    assert lookup(url, prompt=text, cache_salt="tenant-b")["tokens"] == 0  # another tenant's
    assert complete(url, model, text) == hit, "the lookup's answer is not what a request loads"


def test_clear_a_prefix_then_everything_is_what_the_engine_then_does(server):
    url, model, store = server
    text = prompt_text(12)
    complete(url, model, text)
    hit = lookup(url, prompt=text)["tokens"]
    assert hit > 0
    status, res = http(url, "/kvplug/v1/clear", {"scope": "prefix", "prompt": text,
                                                 "tiers": ["local_cpu"]})
    assert status == 200 and res["ok"], res
    assert list(res["tiers"]) == ["local_cpu"]
    assert res["tiers"]["local_cpu"]["removed"] >= hit // 256 and \
        res["tiers"]["local_cpu"]["remaining"] == 0
    now = lookup(url, prompt=text)
    assert now["tokens"] == hit and now["tiers"]["local_cpu"]["held"] == 0
    assert now["tiers"]["posix"] == {"held": hit, "served": hit}

    assert disk_files(store) > 0
    status, res = http(url, "/kvplug/v1/clear", {"scope": "all"})
    assert status == 200 and res["ok"], res
    assert set(res["tiers"]) == {"local_cpu", "posix"}
    assert res["tiers"]["posix"]["removed"] > 0 and res["tiers"]["posix"]["remaining"] == 0
    assert disk_files(store) == 0, "clear said complete with chunk files left on disk"
    assert lookup(url, prompt=text)["tokens"] == 0
    assert lookup(url, prompt=prompt_text(11))["tokens"] == 0  # the earlier test's prompt too
    assert complete(url, model, text) == 0, "a cleared chunk was served"


def test_status_and_clears_that_cannot_be_done(server):
    url, model, _ = server
    complete(url, model, prompt_text(13))
    status, out = http(url, "/kvplug/v1/status")
    assert status == 200
    tiers = {t["name"]: t for t in out["tiers"]}
    assert tiers["posix"]["capacity_bytes"] == 1 << 30 and not tiers["posix"]["never_blocks"]
    assert tiers["local_cpu"]["never_blocks"] and tiers["posix"]["may_block"]  # (deprecated)
    assert tiers["local_cpu"]["entries"] > 0 and tiers["posix"]["used_bytes"] > 0
    assert len(out["ranks"]) == 1 and out["chunk_size"] == 256
    assert tiers["local_cpu"]["policies"] == {"eviction": {"policy": "s3fifo"},
                                              "admission": {"policy": "always"}}
    assert tiers["posix"]["policies"] == {"eviction": {"policy": "lru"},
                                          "admission": {"policy": "always"}}
    status, out = http(url, "/kvplug/v1/clear", {"scope": "tier", "tiers": ["nope"]})
    assert status == 404 and "nope" in out["error"]["message"]  # vLLM's error body


def run(*args: str, key: str | None = KEY, **extra: str) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    env.update(extra)
    if key:
        env["VLLM_API_KEY"] = key
    return subprocess.run(kvplug_cli(*args), capture_output=True, text=True, timeout=600,
                          env=env)


def test_cache_commands_over_http(server):
    url, _, _ = server
    text = prompt_text(13)
    out = run("cache", "lookup", "--url", url, "--prompt", text, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == lookup(url, prompt=text)
    out = run("cache", "clear", "--url", url, "--all", key=None)
    assert out.returncode == 1 and "401" in out.stderr and "--api-key" in out.stderr
    out = run("cache", "clear", "--url", url, "--tier", "local_cpu")
    assert out.returncode == 0, out.stderr
    assert "done" in out.stdout and "local_cpu" in out.stdout
    out = run("cache", "status", "--url", url)
    assert out.returncode == 0 and "posix" in out.stdout and "s3fifo" in out.stdout


def test_warm_prefills_what_is_not_held_and_resumes(server, tmp_path):
    url, model, _ = server
    held = prompt_text(13)  # stored by the tests above (posix)
    new = [prompt_text(21, 60), prompt_text(22, 60)]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in [held, *new]))
    out = run("warm", "--url", url, "--prompts", str(prompts), "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert (summary["prefilled"], summary["skipped"], summary["held_fully"]) == (2, 1, 3)
    assert summary["tiers"]["posix"]["stored"] > 0
    for p in new:
        assert complete(url, model, p) == lookup(url, prompt=p)["tokens"] > 0
    out = run("warm", "--url", url, "--prompts", str(prompts), "--json")
    again = json.loads(out.stdout)
    assert out.returncode == 0 and again["prefilled"] == 0 and again["skipped"] == 3


def test_warm_in_process_fills_a_directory_the_server_shares(server, tmp_path):
    """``kvplug warm --model`` (an engine in its own process, no server) stores into the posix
    directory the server uses: the server's lookup then finds the prompts, a request loads them."""
    url, model, store = server
    new = [prompt_text(31, 60), prompt_text(32, 60)]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in new))
    cfg = tmp_path / "kvplug.yaml"
    cfg.write_text("tiers:\n  - backend: local_cpu\n    options: {capacity: 64MiB}\n"
                   f"  - backend: posix\n    options: {{path: {store}, capacity: 1GiB}}\n")
    args = [f"--engine-arg={a}" for a in ("enforce_eager=true", "dtype=bfloat16",
                                          "block_size=128", "max_model_len=4096",
                                          "max_num_seqs=4")]
    # vLLM's in-process layout (tests/conftest.py): one interpreter imports torch and vLLM, not three
    out = run("warm", "--model", model, "--kvplug-config", str(cfg), "--prompts", str(prompts),
              *args, "--json", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false",
              VLLM_ENABLE_V1_MULTIPROCESSING="0", KVPLUG_CACHE_DIR=str(tmp_path / "cache"))
    assert out.returncode == 0, "\n".join(
        line for line in out.stderr.splitlines() if "Error" in line or "error" in line)[-6000:]
    summary = json.loads(out.stdout)
    assert summary["prefilled"] == 2 and summary["held_fully"] == 2, summary
    assert summary["tiers"]["posix"]["stored"] > 0 and summary["tiers"]["posix"]["held_before"] == 0
    for p in new:
        assert lookup(url, prompt=p)["tiers"]["posix"]["held"] > 0, \
            "the server does not see what the in-process warm stored"
        assert complete(url, model, p) == lookup(url, prompt=p)["tokens"] > 0


def test_clear_by_tenant_and_pins_on_the_engine(server):
    """A tenant's entries go (files counted on disk), another's stay; a pinned prompt outlives a
    clear of everything and is served after it; an unpin lets the next clear take it."""
    from kvplug.policies.tenants import tenant_id

    url, model, store = server
    a_text, b_text = prompt_text(41), prompt_text(42)
    complete(url, model, a_text, cache_salt="tenant-a")
    complete(url, model, b_text, cache_salt="tenant-b")
    a_id = tenant_id("tenant-a")

    def files_of(tenant: str) -> int:
        return sum(1 for p in store.rglob("*.safetensors") if f".t{tenant}" in p.name)

    assert files_of(a_id) > 0 and lookup(url, prompt=a_text, cache_salt="tenant-a")["tokens"] > 0
    b_look = lookup(url, prompt=b_text, cache_salt="tenant-b")
    b_hit = b_look["tokens"]
    # per tier under the tenant's keys too (before: 0, the workers keyed them without it)
    assert b_look["tiers"]["posix"]["held"] == b_look["tiers"]["local_cpu"]["held"] == b_hit
    status, res = http(url, "/kvplug/v1/clear", {"scope": "tenant", "tenant": "tenant-a"})
    assert status == 200 and res["ok"], res
    assert res["tiers"]["posix"]["removed"] > 0 and res["tiers"]["local_cpu"]["removed"] > 0
    assert files_of(a_id) == 0, "the clear said complete with the tenant's files on disk"
    assert "tenant-a" not in json.dumps(res)
    assert lookup(url, prompt=a_text, cache_salt="tenant-a")["tokens"] == 0
    assert lookup(url, prompt=b_text, cache_salt="tenant-b")["tokens"] == b_hit > 0
    assert complete(url, model, a_text, cache_salt="tenant-a") == 0, "a cleared chunk was served"

    out = run("cache", "pin", "--url", url, "--prompt", b_text, "--cache-salt", "tenant-b")
    assert out.returncode == 0 and "done" in out.stdout, out.stdout + out.stderr
    status, res = http(url, "/kvplug/v1/clear", {"scope": "all"})
    assert not res["ok"] and res["tiers"]["posix"]["remaining"] > 0  # the pinned chunks
    assert lookup(url, prompt=b_text, cache_salt="tenant-b")["tokens"] == b_hit
    assert complete(url, model, b_text, cache_salt="tenant-b") == b_hit
    status, res = http(url, "/kvplug/v1/unpin", {"prompt": b_text, "cache_salt": "tenant-b"})
    assert status == 200 and res["ok"] and res["tiers"]["posix"]["unpinned"] > 0, res
    assert json.loads((store / "kvplug-pins.json").read_text())["pins"] == []
    status, res = http(url, "/kvplug/v1/clear", {"scope": "all"})
    assert res["ok"], res
    assert lookup(url, prompt=b_text, cache_salt="tenant-b")["tokens"] == 0
    # a tenant's use for the dashboard test below (the per-tenant metric)
    complete(url, model, prompt_text(43), cache_salt="tenant-c")


def _names(path: Path) -> set[str]:
    return set(re.findall(r"vllm:kvplug_[a-z_]+", path.read_text()))


def test_dashboard_and_alerts_name_metrics_the_engine_exports(server):
    """Every metric deploy/ names is on the engine's /metrics (a family or a sample)."""
    from kvplug.policies.tenants import tenant_id
    from prometheus_client.parser import text_string_to_metric_families

    url, model, _ = server
    # bytes per tenant, by its id (sampled every 10 s while the engine steps), never the salt
    c_id = tenant_id("tenant-c")
    pattern = (r'vllm:kvplug_tier_tenant_bytes\{(?=[^}]*tenant="' + c_id
               + r'")(?=[^}]*tier="posix")[^}]*\} [1-9]')
    for i in range(40):
        with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
            text = r.read().decode()
        if re.search(pattern, text):
            break
        complete(url, model, f"step {i}")  # steps, so the workers sample again
        time.sleep(1)
    assert re.search(pattern, text), "no per-tenant bytes for tenant-c on /metrics"
    assert "tenant-c" not in text
    exported = set()
    for fam in text_string_to_metric_families(text):
        exported.add(fam.name)
        exported.update(s.name for s in fam.samples)
        if fam.type == "counter":
            exported.add(fam.name + "_total")
        if fam.type == "histogram":
            exported.update(fam.name + sfx for sfx in ("_bucket", "_sum", "_count"))
    dashboard = ROOT / "deploy/grafana/kvplug.json"
    rules = ROOT / "deploy/prometheus/kvplug-rules.yaml"
    json.loads(dashboard.read_text())
    named = _names(dashboard) | _names(rules)
    assert len(named) >= 15
    assert not named - exported, f"not on /metrics: {sorted(named - exported)}"
    # the levels are set (a gauge per tier), not just declared
    assert re.search(r'vllm:kvplug_tier_capacity_bytes\{[^}]*tier="posix"[^}]*\} 1\.07374', text)



def test_alert_rules_pass_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus; "
                    "scripts/setup.sh does it)")
    out = subprocess.run([promtool, "check", "rules",
                          str(ROOT / "deploy/prometheus/kvplug-rules.yaml")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


# -- the API fuzzed against its own OpenAPI schema (last: it clears what the tests above stored)
def test_api_answers_as_its_schema_says(server):
    """Generated calls of every /kvplug/ operation: no 5xx, every status documented, every
    body as its schema says (schemathesis' checks)."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(server[0] + "/openapi.json").include(
        path_regex="^/kvplug/")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert sorted(op.label for op in ops) == [
        "GET /kvplug/v1/status", "POST /kvplug/v1/clear", "POST /kvplug/v1/lookup",
        "POST /kvplug/v1/pin", "POST /kvplug/v1/unpin"]
    for op in ops:
        @given(case=op.as_strategy())
        @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None)
        def call(case) -> None:
            case.validate_response(case.call(headers={"Authorization": f"Bearer {KEY}"},
                                             timeout=120))

        call()
