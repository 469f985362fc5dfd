"""``KVPlugConnector`` against the installed vLLM's ``KVConnectorBase_V1`` and ``SupportsHMA``:
every abstract method implemented and every override callable as vLLM calls it (the same check
``scripts/check_vllm_api.py PATH`` runs against another vLLM tree); KV events carry the group
fields where the installed ``BlockStored`` has them. Negative controls: a broken override and a
missing abstract method are reported."""

from __future__ import annotations

from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from kvplug.connector import KVPlugConnector  # noqa: E402
from kvplug.connector.compat import api_problems, event_group_fields, tree_api  # noqa: E402

ROOT = Path(vllm.__file__).resolve().parent.parent


def test_connector_matches_the_installed_vllm():
    problems, _ = api_problems(KVPlugConnector, tree_api(ROOT))
    assert problems == []
    assert not KVPlugConnector.__abstractmethods__


def test_the_check_reports_a_broken_override_and_a_missing_method():
    def get_finished(self, finished_req_ids, extra):  # one more required parameter
        return None, None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata):  # no **kwargs
        return None

    broken = type("Broken", (KVPlugConnector,), {"get_finished": get_finished,
                                                 "save_kv_layer": save_kv_layer})
    problems, _ = api_problems(broken, tree_api(ROOT))
    assert problems == [
        "KVConnectorBase_V1.get_finished: Broken's extra parameter 'extra' has no default",
        "KVConnectorBase_V1.save_kv_layer: Broken's takes no **kwargs; vLLM's does (vLLM may "
        "pass more keywords)"]
    api = tree_api(ROOT)
    api["KVConnectorBase_V1"] = {**api["KVConnectorBase_V1"],
                                 "brand_new_hook": api["KVConnectorBase_V1"]["wait_for_save"]}
    problems, _ = api_problems(KVPlugConnector, api)
    assert problems == ["KVConnectorBase_V1.brand_new_hook: abstract, not implemented"]


def test_a_tree_without_the_base_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="give the directory that holds vllm/"):
        tree_api(tmp_path)


def test_event_fields_name_each_group_and_its_kind():
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.bfloat16,
                            sliding_window=64)
    kv_cache_config = KVCacheConfig(num_blocks=4, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["a"], full),
                                                     KVCacheGroupSpec(["b"], swa)])
    assert event_group_fields(kv_cache_config) == [
        {"group_idx": 0, "kv_cache_spec_kind": "full_attention",
         "kv_cache_spec_sliding_window": None},
        {"group_idx": 1, "kv_cache_spec_kind": "sliding_window",
         "kv_cache_spec_sliding_window": 64}]
