"""KV cache groups (vLLM's hybrid manager): classification, per-group keys, what a sliding-window
group stores and loads, and where a lookup's hit stops (connector/groups.py, no engine).

The engine-level checks (exact hits on a real sliding-window model, the controls) are in
test_connector_hma.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from kvplug.connector.protocol.groups import (
    FULL,
    SLIDING,
    UNSUPPORTED,
    GroupInfo,
    GroupLayout,
    group_hash,
    layout_of,
    load_parts,
    lookup_groups,
    store_targets,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

BS, CS = 16, 64  # block and chunk size (4 blocks a chunk)


def _full() -> FullAttentionSpec:
    return FullAttentionSpec(BS, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)


def _swa(window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(BS, num_kv_heads=1, head_size=8, dtype=torch.bfloat16,
                             sliding_window=window)


def _config(*specs) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=100, kv_cache_tensors=[], kv_cache_groups=groups)


def _layout(window: int) -> GroupLayout:
    return GroupLayout([GroupInfo(0, SLIDING, "SlidingWindowSpec", window, 1),
                        GroupInfo(1, FULL, "FullAttentionSpec", 0, 1)], BS)


def test_layout_from_vllm_kv_cache_config():
    one = layout_of(_config(_full()), BS)
    assert not one.multi and one.servable
    two = layout_of(_config(_swa(100), _full()), BS)
    assert two.multi and two.servable
    assert [(g.kind, g.window) for g in two.groups] == [(SLIDING, 100), (FULL, 0)]
    mamba = MambaSpec(BS, shapes=((4, 4),), dtypes=(torch.float32,))
    hybrid = layout_of(_config(mamba, _full()), BS)
    assert not hybrid.servable and hybrid.groups[0].kind == UNSUPPORTED
    assert "0 (MambaSpec)" in hybrid.unsupported_message()
    assert not layout_of(_config(_swa(100), FullAttentionSpec(
        2 * BS, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)), BS).servable


def test_group_keys_are_distinct():
    h = random.Random(1).randbytes(32)
    lay = _layout(40)
    a, b = (group_hash(h, g) for g in lay.groups)
    assert len({a, b, h}) == 3 and len(a) == len(h)
    other = GroupInfo(0, SLIDING, "SlidingWindowSpec", 41, 1)  # another window: another key
    assert group_hash(h, other) != a


def test_store_leaves_out_sliding_blocks_outside_the_window():
    lay = _layout(40)
    h = b"h" * 32
    swa = [0, 0, 7, 8, 9, 10]  # blocks 0-1 fell out of the window (null block 0)
    full = [1, 2, 3, 4, 5, 6]
    out = store_targets(lay, [swa, full], h, 0, CS, BS)  # chunk 0: blocks 0-3
    assert out == [(group_hash(h, lay.groups[1]), [1, 2, 3, 4])]
    out = store_targets(lay, [swa, full], h, CS, CS + 2 * BS, BS)  # a partial chunk: 4-5
    assert [ids for _, ids in out] == [[9, 10], [5, 6]]
    assert store_targets(lay, [swa, full], h, CS, 2 * CS, BS) is None  # table too short


def test_load_writes_only_live_sliding_blocks():
    lay = _layout(40)
    h = b"h" * 32
    swa = [0, 0, 0, 0, 0, 0, 17, 18]  # hit of 128 tokens: window keeps blocks 6-7 (tokens 89+)
    full = list(range(1, 9))
    c0 = load_parts(lay, [swa, full], h, 0, CS, 0, BS)
    assert [(p.block_ids, p.pages, p.counts) for p in c0] == [([1, 2, 3, 4], slice(0, 4), True)]
    c1 = load_parts(lay, [swa, full], h, CS, 2 * CS, 0, BS)
    assert [(p.block_ids, p.pages, p.counts) for p in c1] == [
        ([17, 18], slice(2, 4), True), ([5, 6, 7, 8], slice(0, 4), False)]
    assert c1[0].num_pages == 4
    # vLLM already holds the first 5 blocks: only the rest is written
    c1 = load_parts(lay, [swa, full], h, CS, 2 * CS, 5 * BS, BS)
    assert [(p.block_ids, p.pages) for p in c1] == [([17, 18], slice(2, 4)),
                                                    ([6, 7, 8], slice(1, 4))]
    with pytest.raises(ValueError, match="null block in full-attention group"):
        load_parts(lay, [swa, [0] * 8], h, 0, CS, 0, BS)


class Store:
    """A set of stored hashes; ``contains`` answers the leading run (as lookup_prefix)."""

    def __init__(self, have: set[bytes]) -> None:
        self.have = have
        self.asked = 0

    def contains(self, keys: list[bytes]) -> tuple[int, list[str]]:
        self.asked += 1
        n = next((i for i, k in enumerate(keys) if k not in self.have), len(keys))
        return n, ["l1"] * n


def _hashes(n: int) -> list[bytes]:
    rng = random.Random(n)
    return [rng.randbytes(32) for _ in range(n)]


def _stored(lay: GroupLayout, hashes: list[bytes], full: range, swa: range) -> set[bytes]:
    g_swa, g_full = lay.groups
    return ({group_hash(hashes[i], g_full) for i in full}
            | {group_hash(hashes[i], g_swa) for i in swa})


def test_hit_needs_the_window_chunks_only():
    lay = _layout(40)  # the window at 192 tokens: tokens 153.. -> block 9 -> chunk 2
    hs = _hashes(3)
    st = Store(_stored(lay, hs, range(3), range(2, 3)))
    hit = lookup_groups(lay, lambda h: h, st.contains, hs, [], CS, BS)
    assert hit.tokens == 3 * CS
    assert set(hit.chunk_of) == {0, 1, 2}


def test_hit_stops_where_a_sliding_window_is_missing():
    lay = _layout(40)
    hs = _hashes(3)
    # every full chunk, but the sliding group's chunk 2 was not stored (out of window at save)
    st = Store(_stored(lay, hs, range(3), range(0, 2)))
    assert lookup_groups(lay, lambda h: h, st.contains, hs, [], CS, BS).tokens == 2 * CS
    # a window longer than a chunk needs two chunks of the sliding group
    wide = _layout(100)  # at 192 tokens: tokens 93.. -> block 5 -> chunks 1 and 2
    st = Store(_stored(wide, hs, range(3), range(2, 3)))
    assert lookup_groups(wide, lambda h: h, st.contains, hs, [], CS, BS).tokens == 0
    st = Store(_stored(wide, hs, range(3), range(1, 3)))
    assert lookup_groups(wide, lambda h: h, st.contains, hs, [], CS, BS).tokens == 3 * CS
    # control: a full group missing a chunk stops the hit before it, whatever the window
    st = Store(_stored(lay, hs, range(1), range(0, 3)))
    assert lookup_groups(lay, lambda h: h, st.contains, hs, [], CS, BS).tokens == CS


def test_tail_hit_with_only_its_window_stored():
    lay = _layout(20)  # a tail ending at 160: window tokens 141.. -> block 8 -> the tail
    hs = _hashes(2)
    tail = random.Random(7).randbytes(32)
    g_swa, g_full = lay.groups
    st = Store(_stored(lay, hs, range(2), range(0)) | {group_hash(tail, g_full),
                                                        group_hash(tail, g_swa)})
    hit = lookup_groups(lay, lambda h: h, st.contains, hs, [(160, tail)], CS, BS)
    assert hit.tokens == 160
    # without the tail's sliding part the hit falls back to the chunks, which lack their window
    st.have.discard(group_hash(tail, g_swa))
    assert lookup_groups(lay, lambda h: h, st.contains, hs, [(160, tail)], CS, BS).tokens == 0
