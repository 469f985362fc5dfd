"""``kvplug serve``: vLLM's OpenAI server with kvplug's connector, configured by name.

The server test starts the real command on 127.0.0.1 (a free port) with the tiny local model (random
weights, its own locally trained BPE tokenizer) and vLLM's prefix cache off, so every cached token
a warm request reports was loaded by kvplug. The command never passes ``kv_connector_module_path``:
the connector is found through kvplug's ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time

import pytest

from tests.support.server_helpers import TINY_SERVER_ARGS, free_port, kvplug_cli, running_server

CHUNK = 256
BLOCK = 128  # TINY_SERVER_ARGS' --block-size


def test_print_command_configures_the_connector_by_name(tmp_path):
    cfg = tmp_path / "kvplug.yaml"
    cfg.write_text("tiers:\n  - backend: local_cpu\n    options: {capacity: 64MiB}\n")
    out = subprocess.run(kvplug_cli("serve", "some/model", "--kvplug-config", str(cfg), "--port",
                                    "9999", "--max-model-len", "2048", "--print-command"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    argv = shlex.split(out.stdout)
    assert argv[argv.index("-m") + 1] == "vllm.entrypoints.openai.api_server"
    assert argv[argv.index("--model") + 1] == "some/model"
    assert argv[-4:] == ["--port", "9999", "--max-model-len", "2048"]  # passed through unchanged
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "KVPlugConnector", "kv_role": "kv_both",
                  "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {"config_file": str(cfg.resolve())}}


def test_bad_kvplug_config_and_own_flag_fail_before_vllm_starts(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  - backend: local_cpu\n    options: {capacity: 64MiB, bogus: 1}\n")
    out = subprocess.run(kvplug_cli("serve", "m", "--kvplug-config", str(bad)),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "bogus" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run(kvplug_cli("serve", "m", "--kv-transfer-config", "{}"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "--kvplug-config" in out.stderr


@pytest.mark.vllm
def test_plugin_registers_the_connector_once():
    from kvplug.connector.plugin import register
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    register()
    assert register() is False  # a second call changes nothing and does not raise
    cls = KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector="KVPlugConnector", kv_role="kv_both"))
    assert f"{cls.__module__}.{cls.__name__}" == "kvplug.connector.connector.KVPlugConnector"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``kvplug serve`` on the tiny model; yields (base URL, served model name, store dir, log)."""
    from kvplug.connector.demo.model import make_model

    base = tmp_path_factory.mktemp("serve")
    model = make_model("tiny", root=base / "models")
    store = base / "chunks"
    cfg = base / "kvplug.yaml"
    cfg.write_text("tiers:\n  - backend: local_cpu\n    options: {capacity: 256MiB}\n"
                   f"  - backend: posix\n    options: {{path: {store}, capacity: 1GiB}}\n")
    port = free_port()
    argv = kvplug_cli("serve", str(model), "--kvplug-config", str(cfg), "--port", str(port),
                      *TINY_SERVER_ARGS)
    with running_server(argv, base, port) as (url, log):
        yield url, str(model), store, log


@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_serve_warm_request_reports_cached_tokens_from_kvplug(server):
    from kvplug.connector.demo.tokenizer import sentences
    from openai import OpenAI

    url, model, store, log = server
    client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=300)
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
