"""Codecs and bad input: an encoded chunk whose frames were changed (parameters, geometry,
truncation, flipped bytes, overruns, magic) is a logged miss, never other bytes in a block; a
flipped file byte and wrong codec metadata in the header are misses too.

Real posix tiers on real files, rewritten with every checksum recomputed (what a buggy writer or a
tier without checksums could hand back); a control rewrite that changes nothing still reads.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from kvplug import chunkfile as cf
from kvplug.memory import heap_memory_obj
from kvplug.testing import make_key

from tests.support.codec_helpers import LAYERS, files, header_of, kv_obj, manager, posix, stored


# -- bad input ---------------------------------------------------------------------------------
def rewrite(path, edit) -> None:
    """Rewrite a chunk file with its layer slots changed by ``edit(slots)`` and every checksum
    recomputed (what a buggy writer or a tier without checksums could hand back)."""
    head = header_of(path)
    data = path.read_bytes()
    slots = [bytearray(data[o : o + head.layer_nbytes]) for o in head.data_offsets]
    edit(slots)
    t = torch.frombuffer(bytearray(b"".join(slots)), dtype=torch.uint8)
    obj = heap_memory_obj(head.shape, fmt=head.fmt, num_tokens=head.num_tokens)
    obj.tensor.copy_(t.reshape(head.shape))
    obj.meta = type(head.meta)(head.shape, head.dtype, head.fmt, head.num_tokens, head.codec)
    header, bufs = cf.encode_chunk(head.key, obj)
    path.write_bytes(header + b"".join(bytes(b) for b in bufs))


def frame_doc(slot: bytearray) -> tuple[dict, int, int]:
    jlen = int.from_bytes(slot[4:8], "little")
    return json.loads(bytes(slot[16 : 16 + jlen])), jlen, int.from_bytes(slot[8:16], "little")


def set_doc(slot: bytearray, doc: dict, old_jlen: int) -> None:
    plen = int.from_bytes(slot[8:16], "little")
    payload = bytes(slot[16 + old_jlen : 16 + old_jlen + plen])
    desc = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    new = bytes(slot[:4]) + len(desc).to_bytes(4, "little") + slot[8:16] + desc + payload
    slot[:] = new.ljust(len(slot), b"\0")[: max(len(slot), len(new))]


def _wrong_params(slots):
    doc, jlen, _ = frame_doc(slots[1])
    doc["params"]["lib"] = "zstandard"
    set_doc(slots[1], doc, jlen)


def _wrong_geometry(slots):
    for s in slots:
        doc, jlen, _ = frame_doc(s)
        doc["page_bytes"] //= 2
        doc["blocks"] *= 2
        doc.pop("raw_xxh3")
        set_doc(s, doc, jlen)


def _truncated_payload(slots):
    doc, jlen, plen = frame_doc(slots[2])
    payload = bytes(slots[2][16 + jlen : 16 + jlen + plen // 2])
    doc["payload_xxh3"] = cf.checksum(payload)
    desc = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    new = b"KVCF" + len(desc).to_bytes(4, "little") + len(payload).to_bytes(8, "little") + desc
    slots[2][:] = (new + payload).ljust(len(slots[2]), b"\0")


def _flipped_payload(slots):
    doc, jlen, plen = frame_doc(slots[0])
    at = 16 + jlen + plen // 2
    slots[0][at] ^= 0x40


def _flipped_payload_rehashed(slots):
    """The payload digest recomputed too: only the raw checksum after decoding can tell."""
    _flipped_payload(slots)
    doc, jlen, plen = frame_doc(slots[0])
    doc["payload_xxh3"] = cf.checksum(bytes(slots[0][16 + jlen : 16 + jlen + plen]))
    set_doc(slots[0], doc, jlen)


def _overrun(slots):
    slots[3][8:16] = (10**9).to_bytes(8, "little")


def _bad_magic(slots):
    slots[0][:4] = b"NOPE"


BAD = [_wrong_params, _wrong_geometry, _truncated_payload, _flipped_payload,
       _flipped_payload_rehashed, _overrun, _bad_magic]


def store_lossless(tmp_path, *ids: int) -> None:
    """Chunks ``ids`` stored on posix through the lossless codec, the writer closed."""
    w = manager(posix(tmp_path, "lossless"))
    for i in ids:
        stored(w, make_key(i), kv_obj(i))
    w.close()


def assert_reads_back(mgr, i: int) -> None:
    """Chunk ``i`` reads back exactly as stored."""
    got = mgr.get(make_key(i))
    assert got is not None and torch.equal(got.tensor, kv_obj(i).tensor)
    got.ref_down()


@pytest.mark.parametrize("edit", BAD, ids=[f.__name__.strip("_") for f in BAD])
def test_bad_encoded_chunk_is_a_miss_with_a_log_line(tmp_path, edit, caplog):
    store_lossless(tmp_path, 0, 1)  # 1: a good neighbour, read after the bad one
    path = cf.chunk_path(tmp_path, make_key(0))
    rewrite(path, edit)
    mgr = manager(posix(tmp_path, "lossless"))
    with caplog.at_level(logging.WARNING, logger="kvplug.codecs"):
        whole = mgr.get(make_key(0))
        parts = [mgr.get_layers(make_key(0), i, 1) for i in range(LAYERS)]
    orig = kv_obj(0).tensor
    if edit is _wrong_geometry:
        # the same bytes under another page geometry: the connector's shape check refuses them
        # (connector/load.py valid_pages), so they never reach a block
        assert whole.meta.shape != orig.shape and torch.equal(whole.byte_view, orig.reshape(-1))
        whole.ref_down()
        for p in parts:
            p.ref_down()
        mgr.close()
        return
    assert whole is None
    # a layer read alone is either a miss or exactly the original layer, never other bytes
    assert any(p is None for p in parts)
    for i, p in enumerate(parts):
        if p is not None:
            assert torch.equal(p.tensor[0], orig[i])
            p.ref_down()
    assert "treated as a miss" in caplog.text
    assert mgr.stats()["disk"]["codec_decode_failures"] >= 1
    assert_reads_back(mgr, 1)
    mgr.close()


def test_control_rewrite_without_edit_still_reads(tmp_path):
    """The bad-input harness itself keeps a file valid when it changes nothing."""
    store_lossless(tmp_path, 0)
    rewrite(cf.chunk_path(tmp_path, make_key(0)), lambda slots: None)
    mgr = manager(posix(tmp_path, "lossless"))
    assert_reads_back(mgr, 0)
    mgr.close()


def test_flipped_file_byte_is_caught_by_the_file_checksum(tmp_path):
    store_lossless(tmp_path, 0)
    path = files(tmp_path)[0]
    head = header_of(path)
    data = bytearray(path.read_bytes())
    data[head.data_offsets[1] + 40] ^= 1
    path.write_bytes(bytes(data))
    mgr = manager(posix(tmp_path, "lossless"))
    assert mgr.get(make_key(0)) is None
    assert mgr.stats()["disk"]["corrupt"] == 1  # the tier's own checksum (over encoded bytes)
    mgr.close()


def test_wrong_codec_metadata_in_the_header_is_a_miss(tmp_path):
    store_lossless(tmp_path, 0)
    path = files(tmp_path)[0]
    data = path.read_bytes()
    path.write_bytes(data.replace(b'\\"name\\":\\"lossless\\"', b'\\"name\\":\\"lossmore\\"', 1))
    assert path.read_bytes() != data
    mgr = manager(posix(tmp_path, "lossless"))
    assert mgr.get(make_key(0)) is None
    mgr.close()
