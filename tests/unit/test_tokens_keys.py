"""Chunk hashing (vs vLLM and recorded vectors), masks, and cache keys."""

from __future__ import annotations

import random

import pytest
from kvplug.errors import ConfigError
from kvplug.keys import CacheKey, model_slug, parse_key_string
from kvplug.tokens import NONE_HASH, TokenDatabase

# Produced by vLLM 0.32's own hash_block_tokens(sha256_cbor, ...) after
# init_none_hash(sha256_cbor), block size 4, tokens 0..9 (last block partial), and one block
# [1, 2, 3, 4] with extra_keys ("img-abc",). Checked where vLLM is absent, too.
RECORDED = [
    "c49ab11fb576db6f376aef58c24f728a0ba1807e8cac5f940f1a5c4c20741898",
    "9d0a7c928c548f9aeea31ae98471cf515045a206851732ac14cb3083c18d40f9",
    "5b2c1a415056a0970a3248d0cf268ad29a7da94b3f3f2b175e64d6b7010c73e8",
]
RECORDED_EXTRA = "175088c895759971fca938b9c177d1903c72052d15631ef8fdfff1b09e1be727"


def test_recorded_vectors():
    token_db = TokenDatabase(4)
    assert [h.hex() for h in token_db.chunk_hashes(list(range(10)), include_partial=True)] == RECORDED
    got = token_db.chunk_hashes([1, 2, 3, 4], extra_keys=lambda s, e: ("img-abc",))
    assert got[0].hex() == RECORDED_EXTRA


def test_matches_vllm_block_hasher_on_random_tokens():
    kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from vllm.utils.hashing import sha256_cbor

    kv_cache_utils.init_none_hash(sha256_cbor)
    assert bytes(kv_cache_utils.NONE_HASH) == NONE_HASH
    rng = random.Random(7)
    for block in (16, 128):
        tokens = [rng.randrange(50_000) for _ in range(block * 5 + 3)]
        parent, expect = None, []
        for start in range(0, len(tokens) - block + 1, block):
            parent = kv_cache_utils.hash_block_tokens(sha256_cbor, parent, tokens[start:start + block])
            expect.append(bytes(parent))
        assert TokenDatabase(block).chunk_hashes(tokens) == expect


def test_incremental_hashes_equal_whole_sequence_hashes():
    """extend_hashes/partial_hash (the scheduler's path, one chunk at a time as a request grows)
    give exactly chunk_hashes' values."""
    token_db = TokenDatabase(4)
    tokens = list(range(3, 22))
    extra = lambda s, e: ("salt",) if s == 0 else None  # noqa: E731
    cache: list[bytes] = []
    assert token_db.extend_hashes(tokens, cache, 2, extra_keys=extra) == token_db.chunk_hashes(
        tokens[:8], extra_keys=extra)
    assert token_db.extend_hashes(tokens, cache, 4, extra_keys=extra) == token_db.chunk_hashes(
        tokens, extra_keys=extra)
    assert len(cache) == 4
    for end in (3, 10, 19):
        whole = token_db.chunk_hashes(tokens[:end], include_partial=True, extra_keys=extra)
        assert token_db.partial_hash(tokens, end, cache, extra_keys=extra) == whole[-1]


def test_hash_chains_over_every_earlier_token():
    token_db = TokenDatabase(8)
    a = list(range(32))
    b = list(a)
    b[0] = 999  # change only the first chunk
    ha, hb = token_db.chunk_hashes(a), token_db.chunk_hashes(b)
    assert all(x != y for x, y in zip(ha, hb)), "a later chunk's hash ignored an earlier token"
    assert token_db.chunk_hashes(a[:16]) == ha[:2], "a prefix must hash like the start of the whole"


def test_partial_chunk_never_equals_full_chunk():
    token_db = TokenDatabase(4)
    partial = token_db.chunk_hashes([1, 2, 3], include_partial=True)
    full = token_db.chunk_hashes([1, 2, 3, 4])
    assert len(partial) == 1 and partial != full
    assert token_db.chunk_hashes([1, 2, 3]) == []  # full chunks only by default


def test_mask_skips_cached_prefix_but_keeps_the_chain():
    token_db = TokenDatabase(4)
    tokens = list(range(12))
    spans = list(token_db.process_tokens(tokens, [False] * 4 + [True] * 8))
    assert [(s.start, s.end) for s in spans] == [(4, 8), (8, 12)]
    assert [s.chunk_hash for s in spans] == token_db.chunk_hashes(tokens)[1:]
    with pytest.raises(ConfigError, match="not a multiple of chunk_size=4"):
        list(token_db.process_tokens(tokens, [False] * 3 + [True] * 9))
    with pytest.raises(ConfigError, match="prefix"):
        list(token_db.process_tokens(tokens, [False, True] + [False] * 10))


def test_bad_chunk_size():
    with pytest.raises(ConfigError, match="chunk_size=0"):
        TokenDatabase(0)


def _key(**kw) -> CacheKey:
    base = dict(model="Qwen/Qwen3-0.6B", kv_dtype="bfloat16", kv_layout="LBHNC-bs128",
                world_size=2, rank=1, chunk_hash=bytes(range(32)))
    base.update(kw)
    return CacheKey(**base)


def test_key_string_is_safe_and_stable():
    evil = _key(model="../../etc/passwd\x00 ; rm -rf /")
    s = evil.to_string()
    assert all(c.isalnum() or c in "._-" for c in s), s
    assert "/" not in s and not s.startswith(".")
    assert s == _key(model="../../etc/passwd\x00 ; rm -rf /").to_string()
    ns, hx = parse_key_string(s)
    assert hx == bytes(range(32)).hex() and s.startswith(ns)
    staged = _key(model_digest="0123456789abcdef", pp_size=2, pp_rank=1, layers="14-28")
    assert parse_key_string(staged.to_string()) == (staged.namespace, staged.hex)
    assert ".pp2-1-L14-28." in staged.to_string()


def test_keys_of_different_configurations_differ():
    base = _key()
    variants = [_key(model="Qwen/Qwen3-1.7B"), _key(kv_dtype="float16"),
                _key(kv_layout="LBNHC-bs16"), _key(world_size=4), _key(rank=0),
                _key(model_digest="00ff"), _key(model_digest="01ff"), _key(pp_size=2),
                _key(pp_size=2, pp_rank=1), _key(pp_size=2, layers="0-2"),
                _key(pp_size=2, layers="0-3")]
    strings = {v.to_string() for v in variants} | {base.to_string()}
    assert len(strings) == len(variants) + 1
    # models whose readable slugs coincide still differ
    assert model_slug("a/b") != model_slug("a_b")


def test_key_fields_round_trip_and_errors():
    k = _key()
    assert CacheKey.from_fields(k.fields()) == k
    # the identity fields round-trip; a key made by hand writes exactly the fields it always did
    full = _key(model_digest="0123456789abcdef", pp_size=2, pp_rank=1, layers="14-28")
    assert CacheKey.from_fields(full.fields()) == full
    assert set(k.fields()) == {"model", "kv_dtype", "kv_layout", "world_size", "rank",
                               "chunk_hash"}
    with pytest.raises(ConfigError, match="pp_rank=2"):
        _key(pp_size=2, pp_rank=2)
    with pytest.raises(ConfigError, match="layers='0-x'"):
        _key(layers="0-x")
    with pytest.raises(ConfigError, match="'rank' is missing"):
        CacheKey.from_fields({kk: v for kk, v in k.fields().items() if kk != "rank"})
    with pytest.raises(ConfigError, match="kv_layout='LBHNC/x'"):
        _key(kv_layout="LBHNC/x")
    with pytest.raises(ConfigError, match="rank=2"):
        _key(rank=2)
    with pytest.raises(ConfigError, match="not a kvplug key string"):
        parse_key_string("../../x")
