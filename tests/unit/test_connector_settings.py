"""Connector settings that change what vLLM does around kvplug: the load-failure
policy warning, no second copy of what the tiers hold after a local prefix hit, the per-request
report kept from API clients unless asked for, and PIECEWISE CUDA graphs in layer-wise mode."""

from __future__ import annotations

import logging
import re

import pytest

from tests.support.vllm_helpers import (
    REPO,
    FakeLookup,
    make_request,
    make_scheduler,
    model_runner_output,
    prompt,
)


@pytest.fixture
def kvplug_log(caplog, monkeypatch):
    """kvplug's log lines, once each (the connector may stop them reaching the root logger)."""
    monkeypatch.setattr(logging.getLogger("kvplug"), "propagate", False)
    monkeypatch.setattr(logging.getLogger("kvplug"), "handlers", [caplog.handler])
    return caplog


def build(model_dir, **kw):
    s = make_scheduler(model_dir, **kw)
    fake = FakeLookup()
    s.connector.scheduler_side.lookup = fake
    return s, fake


def run_request(s, fake, req):
    """Schedule ``req`` to the end, storing what kvplug asks to store into ``fake``; returns
    (vLLM's local hit, the save specs, the kv_transfer_params the client receives)."""
    s.add_request(req)
    saves, local, params = [], None, None
    while s.requests:
        scheduler_output = s.schedule()
        for nr in scheduler_output.scheduled_new_reqs:
            local = nr.num_computed_tokens
        for m in scheduler_output.kv_connector_metadata.requests:
            if m.save is not None:
                saves.append((m.save.start, m.save.end, len(m.save.hashes)))
                fake.stored.update(m.save.hashes)
        for outs in s.update_from_output(scheduler_output, model_runner_output(scheduler_output)).values():
            for o in outs.outputs:
                if o.finished:
                    params = o.kv_transfer_params
    return local, saves, params


# -- 1. kv_load_failure_policy -----------------------------------------------------------------

@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_fail_policy_warns_at_startup(model_dir, kvplug_log, policy):
    make_scheduler(model_dir, policy=policy)
    warned = [r.getMessage() for r in kvplug_log.records
              if "kv_load_failure_policy" in r.getMessage()]
    if policy == "fail":
        assert len(warned) == 1 and '"recompute"' in warned[0]
        assert all(r.levelno == logging.WARNING for r in kvplug_log.records
                   if "kv_load_failure_policy" in r.getMessage())
    else:
        assert warned == []  # the control: the recommended policy is silent


def test_docs_demo_and_template_set_recompute():
    """Every vLLM config kvplug ships (README, demo, backend template) sets the policy."""
    files = [REPO / "README.md", REPO / "connector/demo/run.py",
             *sorted((REPO / "templates/backend").rglob("README.md"))]
    for f in files:
        text = f.read_text()
        configs = len(re.findall(r"kv_connector\W{1,4}KVPlugConnector", text))
        recompute = len(re.findall(r"kv_load_failure_policy\W{1,4}recompute", text))
        assert configs > 0, f  # the check is not vacuous
        assert recompute == configs, f"{f}: {configs} configs, {recompute} set recompute"


# -- 2. a local prefix hit never re-stores what the tiers hold ----------------------------------

def test_local_prefix_hit_does_not_store_again(model_dir):
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(128, sha256_cbor)
    s, fake = build(model_dir, prefix_caching=True)
    tokens = prompt(1000, 21)
    local, saves, _ = run_request(s, fake, make_request("first", tokens, block_hasher=hasher))
    assert (local, saves) == (0, [(0, 896, 4)])  # 3 full chunks + [768, 896) stored once
    local, saves, _ = run_request(s, fake, make_request("again", tokens, block_hasher=hasher))
    assert local == 896  # vLLM's own prefix cache covers everything loadable
    assert saves == []  # ... and the tiers already hold the 4 chunks
    fake.stored.clear()  # control: the tiers lost them, so they are stored again
    local, saves, _ = run_request(s, fake, make_request("lost", tokens, block_hasher=hasher))
    assert (local, saves) == (896, [(0, 896, 4)])


# -- 3. the per-request report reaches the client only when asked for ---------------------------

@pytest.mark.parametrize("report", [False, True])
def test_report_reaches_the_client_only_when_asked(model_dir, report):
    """What vLLM's scheduler hands the front end (and so every API client) at the end."""
    s, fake = build(model_dir, extra={"report_to_client": report})
    _, _, params = run_request(s, fake, make_request("r", prompt(600, 22)))
    if report:
        assert params["kvplug"]["stored_tokens"] == 512  # the control: the report exists
    else:
        assert not (params or {}).get("kvplug")


def test_report_switch_default_in_config():
    from kvplug.connector.protocol.config import ConnectorConfig, load_connector_config

    assert ConnectorConfig.model_fields["report_to_client"].default is False
    assert load_connector_config({"report_to_client": True}).report_to_client is True


# -- 5. layer-wise mode needs PIECEWISE CUDA graphs ---------------------------------------------

def test_layerwise_requires_piecewise_cudagraphs(tmp_path, monkeypatch):
    from kvplug.connector import KVPlugConnector

    f = tmp_path / "kv.yaml"
    f.write_text("layerwise: true\n")
    assert KVPlugConnector.requires_piecewise_for_cudagraph({"layerwise": True}) is True
    assert KVPlugConnector.requires_piecewise_for_cudagraph({"config_file": str(f)}) is True
    assert KVPlugConnector.requires_piecewise_for_cudagraph({}) is False  # bulk: full graphs ok
    assert KVPlugConnector.requires_piecewise_for_cudagraph({"layerwise": False}) is False
    monkeypatch.setenv("KVPLUG_LAYERWISE", "true")
    assert KVPlugConnector.requires_piecewise_for_cudagraph({}) is True


def test_vllm_asks_the_class_with_the_extra_config_dict():
    """vLLM's check (VllmConfig.__post_init__, full CUDA graphs) resolves the class through its
    factory and passes ``kv_connector_extra_config`` as a plain dict."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from tests.support.vllm_helpers import transfer_config

    for layerwise in (True, False):
        kv = KVTransferConfig(**transfer_config("kvplug", {"layerwise": layerwise}))
        cls = KVConnectorFactory.get_connector_class(kv)
        assert cls.requires_piecewise_for_cudagraph(kv.kv_connector_extra_config) is layerwise
