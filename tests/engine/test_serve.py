"""``kvplug serve``: vLLM's OpenAI server with kvplug's connector, configured by name.

The command line and its errors, and the plugin's registration. The real server's warm request
(cached tokens from kvplug; the connector found through kvplug's ``vllm.general_plugins`` entry
point, never ``kv_connector_module_path``) runs on the one ``kvplug serve`` that
tests/engine/test_manage_engine.py starts (a server start is ~40 s of the suite's budget).
"""

from __future__ import annotations

import json
import shlex
import subprocess

import pytest

from tests.support.server_helpers import kvplug_cli


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


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_kv_role_sets_the_disaggregated_roles(role):
    """``--kv-role``: the prefill and decode engines of disaggregated prefill (README)."""
    from click.testing import CliRunner
    from kvplug.cli.serve import serve_cmd

    out = CliRunner().invoke(serve_cmd, ["some/model", "--kv-role", role, "--port", "8100",
                                         "--print-command"])
    assert out.exit_code == 0, out.output
    argv = shlex.split(out.output)
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_role"] == role
    assert argv[-2:] == ["--port", "8100"]  # not passed on to vLLM as its own flag
    bad = CliRunner().invoke(serve_cmd, ["some/model", "--kv-role", "kv_sideways"])
    assert bad.exit_code == 2 and "kv_sideways" in bad.output


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
