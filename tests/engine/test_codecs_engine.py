"""Codecs end to end on a real vLLM engine (CPU): a lossless hit is exact; fp8 is close, and
measurably closer than wrong KV; the lossless codec round-trips real engine KV bit for bit.

Like with like (see tests/engine/test_connector_engine.py): the cold reference runs with chunked prefill
cut at kvplug's chunk boundaries, so its last prefill step does exactly the work of a warm hit.
Loads come from the posix tier alone, in a fresh engine process (L1 off), so every hit passes
through the codec: whole chunks (``get``) and, in layer-wise mode, one layer at a time
(``get_layers``).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.codec_metrics import agreement
from tests.support.vllm_helpers import prompt, run_scenario, same_output, transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]
ENGINES_IN_PROCESS = True  # engines run in-process (tests/conftest.py: _engine_layout)

CHUNK = 256
P = prompt(1600, 11)  # 6 chunks loadable
PROMPTS = [prompt(1100 + 37 * i, 100 + i) for i in range(6)]  # 4 chunks each, fp8 set
CHUNKED = {"max_num_batched_tokens": CHUNK}
HEADS = 2  # the tiny preset's num_key_value_heads


def tiers(path, codec: str | None = None, l1: bool = True, **opts):
    out = [{"backend": "local_cpu", "options": {"capacity": "256MiB"}}] if l1 else []
    disk = {"backend": "posix", "options": {"path": str(path), "capacity": "2GiB"}}
    if codec:
        disk["codec"] = codec
        disk["codec_options"] = opts
    return out + [disk]


def kv(tier_list, **extra):
    return transfer_config("kvplug", {"tiers": tier_list, **extra})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvplug.connector.demo.model import make_model

    return make_model("tiny", root=tmp_path_factory.getbasetemp() / "models")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return {n: tmp_path_factory.mktemp(n) for n in ("raw", "lossless", "fp8", "control")}


@pytest.fixture(scope="module")
def lossless(model, dirs):
    """One cold engine storing raw and through the codec (write-through to both posix tiers);
    then fresh posix-only engines that hit the codec's tier."""
    raw_tier = {**tiers(dirs["raw"], l1=False)[0], "name": "raw"}
    enc_tier = {**tiers(dirs["lossless"], "lossless", l1=False)[0], "name": "lossless"}
    (raw_cold,) = run_scenario(model, kv([*tiers(None)[:1], raw_tier, enc_tier]),
                               [("gen", P, None)], CHUNKED)
    enc_cold = raw_cold
    (bulk,) = run_scenario(model, kv(tiers(dirs["lossless"], "lossless", l1=False)),
                           [("gen", P, None)], CHUNKED)
    (layerwise,) = run_scenario(model, kv(tiers(dirs["lossless"], "lossless", l1=False),
                                          layerwise=True), [("gen", P, None)], CHUNKED)
    return {"raw_cold": raw_cold, "enc_cold": enc_cold, "bulk": bulk, "layerwise": layerwise}


def test_lossless_hit_is_exactly_the_uncompressed_output(lossless):
    assert lossless["enc_cold"]["kvplug"]["stored_tokens"] == 1536
    for mode in ("bulk", "layerwise"):
        hit = lossless[mode]
        assert hit["kvplug"]["tiers"] == {"posix": 1536}, mode
        assert hit["kvplug"]["failed_blocks"] == 0 and hit["cached"] == 1536, mode
        assert same_output(hit, lossless["raw_cold"]), mode


def test_real_engine_kv_round_trips_bit_exact_and_compresses(dirs, lossless, tmp_path):
    """The raw chunk files the engine wrote (real KV) go through a lossless tier and back."""
    from kvplug import chunkfile as cf
    from kvplug.storage_manager import StorageManager

    files = sorted(p for p in dirs["raw"].rglob("*") if cf.is_chunk_file(p.name))
    assert len(files) == 6
    raw = StorageManager({"tiers": [{"backend": "posix", "options": {"path": str(dirs["raw"])}}]})
    enc = StorageManager({"tiers": [{"backend": "posix", "codec": "lossless",
                                     "options": {"path": str(tmp_path)}}]})
    keys = []
    for f in files:
        with open(f, "rb") as fh:
            keys.append(cf.read_header_fd(fh.fileno())[0].key)
    originals = [raw.get(k) for k in keys]
    assert all(o is not None for o in originals)
    enc.batched_put(keys, originals)
    assert enc.flush(120)
    for k, o in zip(keys, originals):
        back = enc.get(k)
        assert back is not None and torch.equal(back.tensor, o.tensor)
        back.ref_down()
    s = enc.stats()["posix"]
    assert s["codec_encoded"] == 6 and s["codec_encoded_bytes"] < s["codec_raw_bytes"]
    for o in originals:
        o.ref_down()
    raw.close()
    enc.close()


def other_prompts_kv(src, dst) -> int:
    """Store under each prompt's full-chunk keys the KV the engine computed for the next prompt
    (read from the raw tier at ``src``): wrong KV of the right shape, for the control."""
    import dataclasses

    from kvplug import chunkfile as cf
    from kvplug.storage_manager import StorageManager
    from kvplug.tokens import TokenDatabase

    first = next(p for p in src.rglob("*") if cf.is_chunk_file(p.name))
    with open(first, "rb") as fh:
        template = cf.read_header_fd(fh.fileno())[0].key
    token_db = TokenDatabase(CHUNK)
    keys = [[dataclasses.replace(template, chunk_hash=h) for h in token_db.chunk_hashes(p)[:4]]
            for p in PROMPTS]  # the first 4 chunks: every prompt has them
    raw = StorageManager({"tiers": [{"backend": "posix", "options": {"path": str(src)}}]})
    out = StorageManager({"tiers": [{"backend": "posix", "options": {"path": str(dst)}}]})
    n = 0
    for i, mine in enumerate(keys):
        theirs = [raw.get(k) for k in keys[(i + 1) % len(keys)]]
        assert all(o is not None for o in theirs), "the cold run did not store every chunk"
        out.batched_put(mine, theirs)
        n += len(mine)
        for o in theirs:
            o.ref_down()
    assert out.flush(120)
    raw.close()
    out.close()
    return n


@pytest.fixture(scope="module")
def fp8(model, dirs, tmp_path_factory):
    """One cold engine stores every prompt raw and through fp8 (write-through to both tiers);
    fresh engines then hit the fp8 tier, and a tier holding another prompt's KV (control)."""
    steps = [("gen", p, None) for p in PROMPTS]
    raw_tier = {**tiers(dirs["control"], l1=False)[0], "name": "raw"}
    fp8_tier = {**tiers(dirs["fp8"], "fp8", l1=False, num_kv_heads=HEADS)[0], "name": "fp8"}
    cold = run_scenario(model, kv([*tiers(None)[:1], raw_tier, fp8_tier]), steps, CHUNKED)
    hits = run_scenario(model, kv([fp8_tier]), steps, CHUNKED)
    wrong_dir = tmp_path_factory.mktemp("wrong")
    assert other_prompts_kv(dirs["control"], wrong_dir) == 4 * len(PROMPTS)
    wrong = run_scenario(model, kv(tiers(wrong_dir, l1=False)), steps, CHUNKED)
    return {"cold": cold, "hits": hits, "wrong": wrong}


def test_fp8_hits_are_close_and_wrong_kv_is_not(fp8):
    # 4 full chunks, plus a block-granular partial chunk where the prompt has a 9th full block
    for h, w in zip(fp8["hits"], fp8["wrong"]):
        assert set(h["kvplug"]["tiers"]) == {"fp8"} and h["kvplug"]["failed_blocks"] == 0
        assert h["kvplug"]["loaded_tokens"] >= 1024 and w["kvplug"]["loaded_tokens"] == 1024
    close = agreement(fp8["cold"], fp8["hits"])
    wrong = agreement(fp8["cold"], fp8["wrong"])
    print("fp8:", close, "wrong KV (another prompt's):", wrong)
    assert not all(same_output(a, b) for a, b in zip(fp8["cold"], fp8["hits"]))  # it is lossy
    assert close["agreement"] > wrong["agreement"]
    assert close["first_token_agreement"] > wrong["first_token_agreement"]
