"""Bad input at every door: seeded random fuzzing of the chunk-file reader, the
config loader and the lookup socket.

* Chunk files: random and mutated headers (flipped bytes, random length prefixes, truncations,
  metadata values replaced by hostile ones, garbage, nested JSON, bodies built to cost a parser:
  millions of empty lists, deep nesting, many keys, a huge string). The only exception that may
  leave the reader is the documented :class:`~kvplug.errors.ChunkFormatError`; no read asks for
  more bytes than the file holds (beyond the fixed 4 KiB probe), nor, for an engine's reader,
  more than its chunks' header bound; a header the reader accepts describes exactly this file.
  The posix and fsspec (``file://``) tiers answer every such file with a miss or the original
  bytes, never an exception or other bytes.
* Config: wrong keys, types and sizes at every level: a :class:`~kvplug.errors.ConfigError` whose
  message names the key and what is allowed.
* Lookup socket: random frames and mutated messages are dropped and counted; the service keeps
  answering real lookups between them.

Seeded (``random.Random``), so a failure reproduces; counts are kept small for CI time.
"""

from __future__ import annotations

import json
import os
import random
import re
import struct
import time

import pytest
import torch
from kvplug import chunkfile as cf
from kvplug.errors import ChunkFormatError, ConfigError
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat, heap_memory_obj

SEED = 16
N_READER = 600
#: The header bound of an engine whose chunks have 3 layers (the most ``_valid`` makes).
ENGINE_HEADER = cf.max_header_bytes(3)

# -- the chunk-file reader -------------------------------------------------------------------------

HOSTILE = ["", "-1", "0", "1", "99999999999999999", "1" * 5000, "1e9", "nan", "[]", "{}", "null",
           "[-1]", "[1e300]", "[1, 2, 3, 4, 5, 6, 7, 8]", "[99999999999, 99999999999]", '["a"]',
           "\u00e9\u4e2d\U0001f600", "x" * 20000, "[" * 3000 + "]" * 3000, "true", "uint8",
           "float64", "kv_pages", "zz" * 32, "00"]


def _key(rng: random.Random) -> CacheKey:
    return CacheKey("org/fuzz", "bfloat16", "LBHNC-bs16", 2, 1, rng.randbytes(32))


def _valid(rng: random.Random) -> tuple[CacheKey, bytes, torch.Tensor]:
    shape = (rng.randint(1, 3), rng.randint(1, 3), rng.choice([7, 1000, 4096]))
    obj = heap_memory_obj(shape, torch.uint8, MemoryFormat.KV_PAGES, rng.randint(1, 64))
    obj.byte_view.copy_(torch.tensor(list(rng.randbytes(obj.nbytes)), dtype=torch.uint8))
    key = _key(rng)
    header, bufs = cf.encode_chunk(key, obj)
    return key, header + b"".join(bytes(b) for b in bufs), obj.byte_view.clone()


def _with_header(data: bytes, doc: object, rng: random.Random) -> bytes:
    """``data`` with its JSON header replaced by ``doc`` (length prefix and padding made valid
    most of the time, so the checks behind them are reached)."""
    hb = cf.header_size(data[:8])
    body = json.dumps(doc).encode() if not isinstance(doc, bytes) else doc
    total = cf.align_up(8 + len(body)) if rng.random() < 0.9 else 8 + len(body)
    return struct.pack("<Q", total - 8) + body + b" " * (total - 8 - len(body)) + data[hb:]


def costly_body(rng: random.Random, size: int) -> bytes:
    """A header body of about ``size`` bytes built to cost a parser: empty lists by the million,
    deep nesting, many keys, one huge string, inside the metadata object or instead of it."""
    open_ = rng.choice([b'{"__metadata__":{"format":', b'{"__metadata__":', b"", b'{"a":'])
    kind = rng.randrange(4)
    if kind == 0:
        body = b"[" + b"[]," * (size // 3) + b"[]]"
    elif kind == 1:
        depth = min(size // 2, 200_000)
        body = b"[" * depth + b"]" * depth
    elif kind == 2:
        body = b"{" + b",".join(b'"k%d":"v"' % i for i in range(size // 12)) + b"}"
    else:
        body = b'"' + b"A" * size + b'"'
    return open_ + body + b"}" * open_.count(b"{")


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One random mutation of a valid chunk file (or a file of random bytes)."""
    hb = cf.header_size(data[:8])
    kind = rng.randrange(10)
    if kind == 9:  # a body built to cost a parser, its length prefix valid (bounded, aligned)
        size = cf.MAX_HEADER - 200 if rng.random() < 0.05 else rng.choice([100, 4000, 40_000,
                                                                           200_000])
        return _with_header(data, costly_body(rng, size), rng)
    if kind == 0:  # flipped bytes in the header
        out = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(hb)] ^= rng.randrange(1, 256)
        return bytes(out)
    if kind == 1:  # a random length prefix (small, huge, just under the bound, aligned or not)
        n = rng.choice([rng.randrange(1 << 64), rng.randrange(cf.MAX_HEADER + 1),
                        rng.randrange(1, cf.MAX_HEADER // cf.ALIGN) * cf.ALIGN - 8,
                        cf.MAX_HEADER - 8, hb - 8 + cf.ALIGN])
        return struct.pack("<Q", n) + data[8:]
    if kind == 2:  # cut short anywhere
        return data[: rng.randrange(len(data))]
    if kind == 3:  # random bytes
        return rng.randbytes(rng.randrange(0, 3 * cf.ALIGN))
    doc = json.loads(data[8:hb])
    meta = doc["__metadata__"]
    if kind == 4:  # a metadata value replaced by a hostile one
        meta[rng.choice(sorted(meta))] = rng.choice(HOSTILE)
    elif kind == 5:  # a metadata field removed, or a value of another JSON type
        name = rng.choice(sorted(meta))
        if rng.random() < 0.5:
            del meta[name]
        else:
            meta[name] = rng.choice([1, None, [], {}, 1.5, True])
    elif kind == 6:  # a tensor entry's offsets, shape or dtype changed
        t = doc[rng.choice([k for k in doc if k != "__metadata__"])]
        field = rng.choice(["data_offsets", "shape", "dtype"])
        t[field] = rng.choice([[0, 1 << 62], [-1, 5], [5, 1], "F64", [], None, [1 << 40]])
    elif kind == 7:  # the header is some other JSON document
        doc = rng.choice([[], {}, None, "text", 1, {"__metadata__": []},
                          {"__metadata__": {"format": "kvplug-chunk"}}])
    else:  # deeply nested JSON (the parser's recursion limit) or invalid UTF-8
        return _with_header(data, rng.choice([b"[" * 100_000 + b"]" * 100_000,
                                              b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
                                              b'{"\xff\xfe":1}']), rng)
    return _with_header(data, doc, rng)


def test_reader_fuzz_only_documented_errors_and_bounded_reads(tmp_path):
    rng = random.Random(SEED)
    path = tmp_path / "f.safetensors"
    outcomes = {"rejected": 0, "accepted": 0}
    for i in range(N_READER):
        _, good, _ = _valid(rng)
        data = mutate(good, rng)
        path.write_bytes(data)
        size = len(data)
        asked: list[tuple[int, int]] = []
        with open(path, "rb") as f:

            def read(offset: int, length: int, fd: int = f.fileno(), asked=asked) -> bytes:
                asked.append((offset, length))
                return os.pread(fd, length, offset)

            try:
                header, raw = cf.read_header(read, size)
            except ChunkFormatError:
                outcomes["rejected"] += 1
                header = None
            except Exception as exc:  # pragma: no cover - the failure this test looks for
                pytest.fail(f"case {i}: {type(exc).__name__} escaped the reader: {exc!r:.300}")
            mark = len(asked)
            try:  # the same file read by an engine of small chunks (their header bound)
                cf.read_header(read, size, max_header=ENGINE_HEADER)
            except ChunkFormatError:
                pass
            except Exception as exc:  # pragma: no cover - the failure this test looks for
                pytest.fail(f"case {i}: {type(exc).__name__} escaped the reader: {exc!r:.300}")
        limit = max(size, cf.HEADER_PROBE)
        assert all(off + n <= limit for off, n in asked), (i, size, asked)
        bounded = asked[mark:]
        assert sum(n for _, n in bounded) <= max(ENGINE_HEADER, cf.HEADER_PROBE), (i, bounded)
        if header is not None:  # accepted: it must describe this very file
            outcomes["accepted"] += 1
            assert header.file_size == size and raw == data[: header.header_bytes]
    assert outcomes["rejected"] > N_READER * 0.8, outcomes  # the mutations do damage


def test_reader_rejects_a_huge_announced_header_without_reading_it(tmp_path):
    """The defect the fuzz test found: a file of a few KiB announcing a 16 MiB header made the
    reader ask for (and allocate) 16 MiB before noticing the file is shorter."""
    path = tmp_path / "f.safetensors"
    path.write_bytes(struct.pack("<Q", cf.MAX_HEADER - 8) + b"{" + b" " * (2 * cf.ALIGN))
    asked: list[int] = []
    with open(path, "rb") as f:
        def read(offset: int, length: int) -> bytes:
            asked.append(length)
            return os.pread(f.fileno(), length, offset)

        with pytest.raises(ChunkFormatError, match="shorter than its header"):
            cf.read_header(read, os.path.getsize(path))
    assert asked == [cf.HEADER_PROBE]


def _tier_backends(tmp_path):
    from kvplug.backends.fsspec import FsspecBackend
    from kvplug.backends.posix import PosixBackend
    from kvplug.hookspecs import TierContext

    posix = PosixBackend(TierContext("disk", PosixBackend.Options(path=str(tmp_path / "p")),
                                     heap_memory_obj))
    fss = FsspecBackend(TierContext("remote", FsspecBackend.Options(
        url=f"file://{tmp_path / 'f'}", namespace_dirs=False, negative_cache_s=0),
        heap_memory_obj))
    return posix, fss


@pytest.mark.parametrize("tier", ["posix", "fsspec"])
def test_tiers_answer_fuzzed_files_with_a_miss_or_the_original(tmp_path, tier):
    rng = random.Random(SEED + 1)
    posix, fss = _tier_backends(tmp_path)
    be, root = (posix, tmp_path / "p") if tier == "posix" else (fss, tmp_path / "f")
    misses = 0
    try:
        for i in range(60):
            key, good, payload = _valid(rng)
            path = root / cf.relative_chunk_path(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(mutate(good, rng))
            be.contains([key], False)  # let the tier learn of the file the way it does
            got = be.get(key)
            if got is None:
                misses += 1
            else:
                assert torch.equal(got.byte_view, payload), f"case {i}: other bytes returned"
                got.ref_down()
    finally:
        posix.close()
        fss.close()
    assert misses > 50


# -- the config loader -----------------------------------------------------------------------------


def _config_cases(rng: random.Random):
    """(dict config, the key the error must name)."""
    from kvplug.connector.protocol.config import ConnectorConfig

    tops = [k for k in ConnectorConfig.model_fields if k != "tiers"]
    posix_opts = ["path", "capacity", "fsync", "io_threads", "max_pending_writes",
                  "rescan_interval_s", "max_pinned_fds"]
    for _ in range(120):
        kind = rng.randrange(5)
        if kind == 0:  # an unknown top-level key, near a real one or random
            k = rng.choice([rng.choice(tops) + "_", "chunksize", "tier", rng.randbytes(4).hex()])
            yield {k: 1}, k
        elif kind == 1:  # a known top-level key of the wrong type or out of range
            k, v = rng.choice([("chunk_size", rng.choice([-1, 0, 1.5, "x", "", None, [], {}, True])),
                               ("lookup_timeout_s", rng.choice([-1, 0, "x", None, [], {}, False])),
                               ("layerwise", rng.choice(["sometimes", 5, None, [], {}, 1.5])),
                               ("save_decode", rng.choice(["sometimes", 5, None, [], {}]))])
            yield {k: v}, k
        elif kind == 2:  # an unknown key inside a tier
            k = rng.choice(["optons", "backends", "timeout", "name_"])
            yield {"tiers": [{"backend": "local_cpu", k: 1}]}, k
        elif kind == 3:  # a bad tier-level value
            yield {"tiers": [{"backend": "local_cpu", "timeout_s": rng.choice([-1, 0, "x", True])}]}, \
                "timeout_s"
        else:  # a bad backend option: unknown, wrong type, bad size
            k = rng.choice([*posix_opts, "capcity", "fsnyc"])
            v = rng.choice(["x", None, [], {}, [1, 2], {"a": 1}, -1, "-5GiB", ""])
            if k in ("capacity", "io_threads", "max_pending_writes", "rescan_interval_s",
                     "max_pinned_fds") and rng.random() < 0.3:
                v = rng.choice([True, False])  # a boolean is not a number
            if k == "path":
                v = rng.choice([[1, 2], None, {}, 5])
            yield {"tiers": [{"backend": "posix", "options": {"path": "/tmp/x", k: v}}]}, k


def _load(cfg: dict, tmp_path):
    """The whole path a config takes: the connector's loader, then the tiers' own options."""
    from kvplug.connector.protocol.config import load_connector_config
    from kvplug.storage_manager import StorageManager

    loaded = load_connector_config(cfg, env={})
    for t in loaded.tiers:
        if t.backend == "posix" and t.options.get("path") == "/tmp/x":
            t.options = {**t.options, "path": str(tmp_path / "cache")}
    StorageManager(loaded).close()


def test_config_errors_name_the_key_and_the_allowed_values(tmp_path):
    rng = random.Random(SEED + 2)
    seen = 0
    for cfg, key in _config_cases(rng):
        with pytest.raises(ConfigError) as err:
            _load(json.loads(json.dumps(cfg)), tmp_path)
        msg = str(err.value)
        assert re.search(rf"(^|[ '.]){re.escape(key)}(['.:]|$)", msg), (cfg, msg)
        assert any(w in msg for w in ("allowed", "should", "Allowed", "valid", "greater", "less",
                                      "at least")), (cfg, msg)
        seen += 1
    assert seen == 120


# -- the lookup socket -----------------------------------------------------------------------------

def test_lookup_socket_drops_and_counts_random_frames(tmp_path, monkeypatch):
    import msgspec
    import zmq
    from kvplug.connector.protocol import lookup as lk

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    path = lk.socket_path(f"fuzz-{os.getpid()}", 0)
    answered: list[int] = []

    def on_lookup(msg):
        answered.append(msg.id)
        return len(msg.hashes) * 16

    svc = lk.LookupService(path, on_lookup, lambda ids: None)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{path}")
    rng = random.Random(SEED + 3)
    valid = lk._encode(lk.Lookup(1, "r", [b"h" * 32, b"g" * 32]))
    expect_dropped = 0
    try:
        for i in range(300):
            kind = rng.randrange(4)
            if kind == 0:
                frames = [rng.randbytes(rng.randrange(0, 200))]
            elif kind == 1:  # a valid message with bytes flipped or cut
                b = bytearray(valid)
                for _ in range(rng.randint(1, 3)):
                    b[rng.randrange(len(b))] ^= rng.randrange(1, 256)
                frames = [bytes(b[: rng.randrange(1, len(b) + 1)])]
            elif kind == 2:  # several frames in one message
                frames = [rng.randbytes(8) for _ in range(rng.randint(2, 4))]
            else:  # well-formed msgpack of the wrong shape
                frames = [msgspec.msgpack.encode(rng.choice(
                    [{"type": "Lookup"}, [1, 2, 3], {"type": "Lookup", "id": "x", "req_id": 1},
                     {"type": "Release", "req_ids": [1]}, {"type": "Other"}, None]))]
            if len(frames) != 1:
                expect_dropped += 1
            else:
                try:
                    lk._decode_msg(frames[0])
                except (msgspec.DecodeError, UnicodeDecodeError):  # msgspec raises both
                    expect_dropped += 1
                else:
                    continue  # a mutation that is still a valid message is not sent
            sock.send_multipart(frames)
            if i % 25 == 0:  # the service still answers a real lookup in between
                sock.send(lk._encode(lk.Lookup(10_000 + i, "real", [b"a" * 32], deadline=1e18)))
                assert sock.poll(10_000), "the lookup service stopped answering"
                reply = lk._decode_reply(sock.recv())
                assert (reply.id, reply.tokens) == (10_000 + i, 16)
        end = time.monotonic() + 30
        while svc.dropped < expect_dropped and time.monotonic() < end:
            time.sleep(0.01)
        assert svc.dropped == expect_dropped and expect_dropped > 200
        assert all(a >= 10_000 for a in answered)  # no junk reached the tiers
    finally:
        sock.close(0)
        ctx.term()
        svc.close()
