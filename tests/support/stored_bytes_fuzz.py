"""The fuzz campaign on stored bytes: targets and mutations shared by the suite's short
run (tests/faults/test_fuzz_stored_bytes.py) and the long one (benchmarks/fuzz_stored_bytes.py).

Every target starts from a valid encoded chunk (raw pages, or ENCODED through a codec) and is fed
a mutated one: bit flips, truncation, extension, length fields, hostile metadata and nested JSON
(tests/faults/test_fuzz_inputs.py's ``mutate``), re-encoded headers claiming huge or foreign shapes with
a valid checksum, and codec frames naming other codecs and module paths. What must hold, for
every example:

* no exception escapes the tier API (a reader's documented error at the library level);
* nothing is imported (modules named by the mutations never reach ``sys.modules``);
* no allocation past the bound (every tensor a read makes is within the engine's geometry);
* nothing is served unless byte-identical to the valid chunk.

Targets: ``header`` (``read_header``/``decode_header``), ``frame`` (``parse_frame`` and the codec
wrapper's decode), and each tier's read through a StorageManager: ``posix``, ``fsspec``
(``file://``), ``value`` (the value tier over an in-memory store), ``resp`` (the reply parser
over a socket). Two more start from hostile inputs of their own:

* ``bounds``: headers built to cost a parser (a length prefix up to ``MAX_HEADER`` over millions
  of empty lists, deep nesting, many keys, a huge string; a squatter's version) read by the
  library with the engine's header bound, and by the posix and value tiers (with a keyring):
  never more header bytes read than the bound, the Python memory a read takes (tracemalloc's
  peak) bounded, never served;
* ``pins``: a posix tier's pins file (``kvplug-pins.json``), valid and sealed, mutated (bit flips,
  cuts, nesting, junk names, a list changed under the old seal, forms other than kvplug's) and
  decoded with and without the keyring: only :class:`~kvplug.backends.posix.pin_store.NotPins`
  leaves, what is accepted lists only chunk names, and under a keyring only the sealed list;
  every 16th through a real tier's start-up scan (it ends; nothing but the listed chunk is
  pinned).
"""

from __future__ import annotations

import json
import random
import re
import socket
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from kvplug import chunkfile as cf
from kvplug.codecs import CodecWrapper, build_frame, parse_frame
from kvplug.errors import ChunkFormatError, CodecError
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat, MemoryObj, MemoryObjMeta, heap_memory_obj
from kvplug.read_memory import ChunkGeometry

if TYPE_CHECKING:  # imported where the tiers are built (the backends import torch's world)
    from kvplug.storage_manager import StorageManager

LAYERS, PAGES, PAGE = 2, 2, 4096
GEOMETRY = ChunkGeometry(LAYERS, PAGES, PAGE, tokens=32)
#: Modules a mutation may name (none is imported by kvplug or its tests).
PLANTED = ("this", "antigravity", "smtplib", "kvplug_fuzz_planted", "xml.dom.minidom")
CODEC_NAMES = [*PLANTED, *(f"{m}:Codec" for m in PLANTED), "os:system", "lossless", "fp8", "",
               "builtins:eval", "kvplug.codecs.lossless:LosslessCodec", "x" * 5000]
TARGETS = ("header", "frame", "posix", "fsspec", "value", "resp", "bounds", "pins")
#: The Python memory one read of a hostile header may take (tracemalloc's peak): parsing a header
#: within the geometry's bound costs a few hundred KiB at most.
PARSE_BOUND = 2 << 20


def key_of(i: int) -> CacheKey:
    return CacheKey("org/fuzz", "bfloat16", "LBHNC-bs16", 1, 0, i.to_bytes(4, "big") * 8)


def valid_chunk(seed: int, encoded: bool) -> tuple[CacheKey, bytes, torch.Tensor]:
    """``(key, file bytes, the pages it holds)``: a raw chunk, or one stored through the
    lossless codec (its frames as the codec wrapper writes them)."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.randint(0, 256, (LAYERS, PAGES, PAGE), dtype=torch.uint8, generator=g)
    obj = heap_memory_obj((LAYERS, PAGES, PAGE), num_tokens=32)
    obj.tensor.copy_(pages)
    k = key_of(seed)
    if encoded:
        obj = encode(k, obj)
    header, bufs = cf.encode_chunk(k, obj)
    return k, header + b"".join(bytes(b) for b in bufs), pages.reshape(-1).clone()


def encode(k: CacheKey, obj: MemoryObj, codec_name: str | None = None) -> MemoryObj:
    from kvplug.codecs.lossless import LosslessCodec
    from kvplug.plugins import BackendInfo

    info = BackendInfo(codec_name or "lossless", "kvplug.codecs.lossless:LosslessCodec", "kvplug",
                       "0")
    w = CodecWrapper("fuzz", LosslessCodec(), info, heap_memory_obj)
    return w.encode(k, obj)


# -- mutations --------------------------------------------------------------------------------
def _reheader(data: bytes, rng: random.Random) -> bytes:
    """The header re-encoded (valid checksum) with a hostile meta: a huge or foreign shape,
    another dtype or format, a codec naming a module, nested JSON in the codec entry."""
    head = cf.decode_header(data[: cf.header_size(data[:8])])
    shape = list(head.shape)
    kind = rng.randrange(5)
    fmt, dtype, codec = head.fmt, head.dtype, head.codec
    if kind == 0:
        shape = [rng.choice([1, 2, 3, 64, 1 << 10, 1 << 20, (1 << 31) - 1]) for _ in shape]
    elif kind == 1:
        shape[rng.randrange(len(shape))] *= rng.choice([2, 8, 4096])
    elif kind == 2:
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64, torch.float8_e4m3fn])
    elif kind == 3:
        fmt = MemoryFormat.ENCODED
        name = rng.choice(CODEC_NAMES)
        codec = json.dumps({"name": name, "package": "evil", "version": "1", "params": {}})
        if rng.random() < 0.3:
            codec = '{"name":"x","params":' + "[" * 5000 + "]" * 5000 + "}"
    else:
        fmt = rng.choice([MemoryFormat.BINARY, MemoryFormat.KV_PAGES])
        codec = ""
        if fmt is MemoryFormat.BINARY:
            shape = [int(torch.tensor(shape).prod())]
    meta = MemoryObjMeta(tuple(shape), dtype, fmt, rng.choice([0, 32, 1 << 40]), codec)
    try:
        layers = cf.chunk_layout(meta)[0]
        if layers > 4096:  # the writer would spell out every layer's entry: claim fewer
            return data
        header = cf.encode_header(head.key, meta, ["0" * 16] * layers)
    except Exception:  # noqa: BLE001 - a meta the writer itself refuses: keep the original
        return data
    return header + data[head.header_bytes :]


def _frames(data: bytes, rng: random.Random) -> bytes:
    """An ENCODED chunk whose frames name another codec (a module path), or other geometry,
    with every checksum (frame and file) recomputed."""
    head = cf.decode_header(data[: cf.header_size(data[:8])])
    if head.fmt is not MemoryFormat.ENCODED:
        return data
    slots = []
    name = rng.choice(CODEC_NAMES)
    for off in head.data_offsets:
        f = parse_frame(data[off : off + head.layer_nbytes])
        blocks, pb = f.blocks, f.page_bytes
        if rng.random() < 0.3:
            blocks, pb = rng.choice([(1 << 20, PAGE), (PAGES, 1 << 28), (0, 0), (PAGES * 2, PAGE)])
        slots.append(build_frame(name if rng.random() < 0.7 else f.codec, f.package, f.version,
                                 f.params, blocks, pb, bytes(f.payload), f.raw_xxh3))
    slot = max(len(s) for s in slots)
    t = torch.zeros((len(slots), 1, slot), dtype=torch.uint8)
    for i, s in enumerate(slots):
        t[i, 0, : len(s)] = torch.frombuffer(bytearray(s), dtype=torch.uint8)
    codec = json.dumps({"name": name, "package": "evil", "version": "1", "params": {}})
    obj = MemoryObj(t, MemoryObjMeta(tuple(t.shape), torch.uint8, MemoryFormat.ENCODED,
                                     head.num_tokens, codec))
    header, bufs = cf.encode_chunk(head.key, obj)
    return header + b"".join(bytes(b) for b in bufs)


def mutate_chunk(data: bytes, seed: int, ops: Sequence[int]) -> bytes:
    """``data`` through the mutations ``ops`` names (0: test_fuzz_inputs' ``mutate``; 1: bit
    flips anywhere; 2: truncation; 3: extension; 4: hostile re-encoded header; 5: hostile
    frames; 6: unchanged), drawn from ``seed``."""
    from tests.faults.test_fuzz_inputs import mutate

    rng = random.Random(seed)
    for op in ops:
        try:
            cf.header_size(data[:8])
            parsable = True
        except ChunkFormatError:
            parsable = False
        if op == 0 and parsable:
            try:
                data = mutate(data, rng)
            except (ValueError, RecursionError, KeyError, TypeError, IndexError, AttributeError):
                pass  # that mutation needs a header it can parse: keep the bytes
        elif op == 1 and data:
            b = bytearray(data)
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            data = bytes(b)
        elif op == 2:
            data = data[: rng.randrange(len(data) + 1)]
        elif op == 3:
            data = data + rng.randbytes(rng.choice([1, 7, 4096, 70000]))
        elif op in (4, 5) and parsable:
            try:
                data = _reheader(data, rng) if op == 4 else _frames(data, rng)
            except (ChunkFormatError, CodecError, ValueError):
                pass  # not a chunk these mutations rewrite: keep the bytes
    return data


def hostile_header(seed: int, ops: Sequence[int]) -> bytes:
    """A chunk file whose header is built to cost a parser (see the module docstring), its
    length prefix announcing up to :data:`~kvplug.chunkfile.MAX_HEADER` (the file may be
    shorter than announced)."""
    from tests.faults.test_fuzz_inputs import costly_body

    rng = random.Random(seed)
    op = ops[0] % 4 if ops else 0
    if op == 3:  # a squatter: a valid, authenticated-looking header of another version
        k, good, _ = valid_chunk(seed, False)
        raw = cf.encode_chunk(k, heap_memory_obj((LAYERS, PAGES, PAGE), num_tokens=32),
                              cf.Keyring(random.Random(seed).randbytes(32)))[0]
        return raw.replace(b'"1+mac"', rng.choice([b'"2+mac"', b'"1+foo"', b'"9+mac"'])) + \
            good[cf.header_size(good[:8]):]
    announced = rng.choice([cf.ALIGN, 3 * cf.ALIGN, 16 * cf.ALIGN, 64 * cf.ALIGN, cf.MAX_HEADER])
    body = costly_body(rng, announced - 64)[: announced - 8]
    if op == 1:  # the file shorter than announced
        body = body[: rng.randrange(len(body) + 1)]
    head = struct.pack("<Q", announced - 8) + body
    return head + b" " * (announced - len(head)) if op != 1 else head


def valid_pins(seed: int, auth: cf.Keyring | None) -> tuple[list[str], str]:
    """A pins list and the file kvplug writes for it (sealed with ``auth``)."""
    from kvplug.backends.posix.pin_store import encode_pins

    rng = random.Random(seed)
    pins = [f"{rng.randrange(256):02x}/{key_of(rng.randrange(1 << 30)).namespace}."
            f"{rng.randbytes(8).hex()}.safetensors" for _ in range(rng.randint(0, 6))]
    return pins, encode_pins(pins, auth)


def mutate_pins(text: str, seed: int, ops: Sequence[int], auth: cf.Keyring | None) -> str:
    """``text`` (a pins file) through ``ops`` (0: bit flips; 1: a cut; 2: nested JSON or a list
    bomb put in; 3: a junk or hostile name added; 4: the list changed under the old seal; 5:
    another JSON form of the same list; 6: unchanged)."""
    from tests.faults.test_fuzz_inputs import HOSTILE, costly_body

    rng = random.Random(seed)
    for op in ops:
        if op == 0 and text:
            b = bytearray(text.encode())
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            text = b.decode("latin-1")
        elif op == 1:
            text = text[: rng.randrange(len(text) + 1)]
        elif op == 2:
            at = rng.randrange(len(text) + 1)
            text = text[:at] + costly_body(rng, rng.choice([50, 5000, 200_000])).decode() + \
                text[at:]
        elif op == 3:
            name = rng.choice(["../../etc/passwd", "00/x.safetensors\u0000", "ab/" + "a" * 300,
                               "zz/x.safetensors", "ab/.hidden.safetensors", *HOSTILE[:6]])
            text = text.replace('"pins": [', f'"pins": [{json.dumps(name)}, ', 1)
        elif op == 4:
            text = text.replace('.safetensors"', '.x.safetensors"', 1)
        elif op == 5:
            try:
                doc = json.loads(text)
            except (ValueError, RecursionError):  # not JSON (any more): nothing to respell
                continue
            text = json.dumps(doc, indent=rng.choice([None, 1]), sort_keys=rng.random() < 0.5,
                              separators=rng.choice([None, (",", ":")]))
    return text


# -- what every example must satisfy ----------------------------------------------------------
@dataclass
class Counts:
    """Per target: examples run, misses, served (byte-identical), rejected (library level)."""

    runs: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TARGETS, 0))
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TARGETS, 0))
    served: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TARGETS, 0))
    exceptions: int = 0
    biggest_tensor: int = 0
    biggest_parse: int = 0  # tracemalloc's peak of one read of a hostile header (bounds)


class TensorWatch:
    """The largest tensor made through ``torch.empty``/``torch.zeros`` while installed."""

    def __init__(self) -> None:
        self.biggest = 0
        self._real = (torch.empty, torch.zeros)

    def _spy(self, real: Callable) -> Callable:
        def made(*args, **kwargs):
            t = real(*args, **kwargs)
            self.biggest = max(self.biggest, t.numel() * t.element_size())
            return t
        return made

    def __enter__(self) -> TensorWatch:
        torch.empty, torch.zeros = self._spy(self._real[0]), self._spy(self._real[1])
        return self

    def __exit__(self, *exc: object) -> None:
        torch.empty, torch.zeros = self._real


def check_served(got: MemoryObj | None, pages: torch.Tensor) -> bool:
    """Whether ``got`` was served (then it must be the valid chunk, byte for byte)."""
    if got is None:
        return False
    try:
        assert torch.equal(got.byte_view, pages), "other bytes than the valid chunk were served"
    finally:
        got.ref_down()
    return True


def nothing_imported() -> None:
    found = [m for m in PLANTED if m in sys.modules]
    assert not found, f"stored bytes imported {found}"


# -- targets ----------------------------------------------------------------------------------
class Campaign:
    """The tiers the targets read through (one StorageManager per tier kind, with the engine's
    geometry), and the counts. Call :meth:`run` per example; :meth:`close` at the end."""

    def __init__(self, root: Path) -> None:
        from kvplug.storage_manager import StorageManager

        self.root = root
        self.counts = Counts()
        self.bound = GEOMETRY.num_layers * max(GEOMETRY.layer_bytes, GEOMETRY.frame_bytes)
        cfg = {"chunk_size": 32}
        mk = lambda tier: StorageManager({**cfg, "tiers": [tier]}, geometry=GEOMETRY)  # noqa: E731
        self.posix = mk({"backend": "posix", "name": "t", "options": {
            "path": str(root / "p"), "rescan_interval_s": 3600}})
        self.fsspec = mk({"backend": "fsspec", "name": "t", "options": {
            "url": f"file://{root / 'f'}", "namespace_dirs": False, "negative_cache_s": 0}})
        self.value = mk({"backend": "tests.support.stored_bytes_fuzz:DictValueTier", "name": "t",
                         "options": {"negative_cache_s": 0}})
        self.frames = CodecWrapper("fuzz", None, None, self.posix.reads.allocate)
        for m in PLANTED:
            sys.modules.pop(m, None)

        self.ring = cf.Keyring(random.Random(7).randbytes(32))
        self.authed = {}  # tiers with a keyring, made when the bounds target first runs
        self.pins_at = 0

    def close(self) -> None:
        for mgr in (self.posix, self.fsspec, self.value, *self.authed.values()):
            mgr.close()

    def run(self, target: str, seed: int, encoded: bool, ops: Sequence[int]) -> None:
        if target in ("bounds", "pins"):
            self.counts.runs[target] += 1
            served = getattr(self, f"_{target}")(seed, encoded, ops)
            nothing_imported()
            (self.counts.served if served else self.counts.misses)[target] += 1
            return
        k, good, pages = valid_chunk(seed, encoded)
        data = mutate_chunk(good, seed, ops)
        self.counts.runs[target] += 1
        with TensorWatch() as w:
            served = getattr(self, f"_{target}")(k, data, pages, good)
        self.counts.biggest_tensor = max(self.counts.biggest_tensor, w.biggest)
        assert w.biggest <= self.bound + (1 << 20), \
            f"{target}: a read made a tensor of {w.biggest} bytes (bound {self.bound})"
        nothing_imported()
        (self.counts.served if served else self.counts.misses)[target] += 1

    def _header(self, k: CacheKey, data: bytes, pages: torch.Tensor, good: bytes) -> bool:
        try:
            head, raw = cf.read_header(lambda off, n: data[off : off + n], len(data))
        except ChunkFormatError:
            return False
        assert head.file_size == len(data) and raw == data[: head.header_bytes]
        return data == good

    def _frame(self, k: CacheKey, data: bytes, pages: torch.Tensor, good: bytes) -> bool:
        try:
            head = cf.decode_header(data[: cf.header_size(data[:8])], len(data))
        except ChunkFormatError:
            return False
        obj = heap_memory_obj(head.shape, head.dtype, head.fmt, head.num_tokens) \
            if head.nbytes <= self.bound else None
        if obj is None or head.fmt is not MemoryFormat.ENCODED:
            if obj is not None:
                obj.ref_down()
            return False
        flat = obj.byte_view.numpy()
        for i, off in enumerate(head.data_offsets):
            flat[i * head.layer_nbytes : (i + 1) * head.layer_nbytes] = \
                memoryview(data)[off : off + head.layer_nbytes]
            try:
                parse_frame(memoryview(data)[off : off + head.layer_nbytes])
            except CodecError:
                pass
        return check_served(self.frames.decode(k, obj, 0), pages)

    def _file_tier(self, mgr: StorageManager, folder: str, layer: int, k: CacheKey,
                   data: bytes, pages: torch.Tensor) -> bool:
        """Plant ``data`` as ``k``'s chunk file of a file tier and read it whole and one layer."""
        path = self.root / folder / cf.relative_chunk_path(k)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        mgr.lookup_prefix([k])
        got = mgr.get(k)
        part = mgr.get_layers(k, layer, 1)
        if part is not None:
            check_served(part, pages.view(LAYERS, -1)[layer])
        served = check_served(got, pages)
        mgr.evict([k])
        path.unlink(missing_ok=True)
        return served

    def _posix(self, k: CacheKey, data: bytes, pages: torch.Tensor, good: bytes) -> bool:
        return self._file_tier(self.posix, "p", 1, k, data, pages)

    def _fsspec(self, k: CacheKey, data: bytes, pages: torch.Tensor, good: bytes) -> bool:
        return self._file_tier(self.fsspec, "f", 0, k, data, pages)

    def _value(self, k: CacheKey, data: bytes, pages: torch.Tensor, good: bytes) -> bool:
        be = self.value.backend("t")
        name = be.name_of(k)
        STORE[name] = data
        got = self.value.get(k)
        part = self.value.get_layers(k, 1, 1)
        if part is not None:
            check_served(part, pages.view(LAYERS, -1)[1])
        STORE.pop(name, None)
        be._headers.pop(name)  # the next example's value is another one
        return check_served(got, pages)

    def _resp(self, k: CacheKey, data: bytes, pages: torch.Tensor, good: bytes) -> bool:
        """The reply parser, fed ``GETRANGE``'s reply of ``data`` and hostile variants of it,
        reading into pieces laid out as the valid chunk is (its header, then its layers)."""
        from kvplug.backends.resp.replies import BulkReader, ProtocolError

        limit = GEOMETRY.stored_bytes
        rng = random.Random(len(data))
        reply = b"$%d\r\n%s\r\n" % (len(data), data)
        choice = rng.randrange(4)
        if choice == 1:
            reply = b"$%d\r\n" % rng.choice([1 << 40, limit + 2, -5, 10**11]) + data[:64]
        elif choice == 2:
            reply = reply[: rng.randrange(len(reply) + 1)]
        elif choice == 3:
            reply = rng.choice([b"-ERR x\r\n", b"_\r\n", b"$-1\r\n", b"$0\r\n\r\n", b"+OK\r\n",
                                b"$--1\r\n", b"$" + b"9" * 70 + b"\r\n", rng.randbytes(100)])
        # the harness's buffer, not a read's allocation: made outside torch.empty/zeros (the watch)
        dest = torch.frombuffer(bytearray(len(data) + 1), dtype=torch.uint8)
        a, b = socket.socketpair()
        a.settimeout(2)
        def send() -> None:
            try:
                b.sendall(reply)
                b.shutdown(socket.SHUT_WR)
            except OSError:  # the parser stopped reading (and closed its end) first
                pass

        t = threading.Thread(target=send)
        t.start()
        try:
            try:
                got = BulkReader(a).bulk_into([(dest.data_ptr(), len(data))], limit + 1)
            except (ProtocolError, ConnectionError, TimeoutError, OSError):
                return False
            if isinstance(got, bytearray):
                assert len(got) <= limit + 1, f"the parser received {len(got)} bytes"
                return False
            return got == len(data) and bytes(dest[: len(data)].numpy()) == data == good
        finally:
            a.close()
            t.join(5)
            b.close()


    def _authed(self, kind: str) -> StorageManager:
        """A posix or value tier with a keyring (``auth_key_env`` through the environment)."""
        import os

        from kvplug.storage_manager import StorageManager

        if kind not in self.authed:
            os.environ.setdefault("KVPLUG_FUZZ_SECRET", random.Random(9).randbytes(32).hex())
            tier = ({"backend": "posix", "name": "t", "options": {
                "path": str(self.root / "pa"), "rescan_interval_s": 3600}} if kind == "posix"
                else {"backend": "tests.support.stored_bytes_fuzz:DictValueTier", "name": "t",
                      "options": {"negative_cache_s": 0}})
            self.authed[kind] = StorageManager({"chunk_size": 32, "tiers": [tier],
                                                "auth_key_env": "KVPLUG_FUZZ_SECRET"},
                                               geometry=GEOMETRY)
        return self.authed[kind]

    def _bounds(self, seed: int, encoded: bool, ops: Sequence[int]) -> bool:
        """A hostile header read by the library under the engine's bound, then planted for the
        posix or the value tier (both with a keyring): nothing past the bound is read, the
        memory a read takes is bounded, nothing is served."""
        import tracemalloc

        data = hostile_header(seed, ops)
        bound = GEOMETRY.header_bytes
        asked: list[int] = []

        def read(off: int, n: int) -> bytes:
            asked.append(n)
            return data[off : off + n]

        tracemalloc.start()
        try:
            try:
                cf.read_header(read, len(data), self.ring, bound)
                raise AssertionError("a hostile header was accepted")
            except ChunkFormatError:
                pass
            assert sum(asked) <= max(bound, cf.HEADER_PROBE), f"read {sum(asked)} header bytes"
            k = key_of(seed)
            mgr = self._authed("posix" if encoded else "value")
            be = mgr.backend("t")
            if encoded:
                path = self.root / "pa" / cf.relative_chunk_path(k, mgr.auth)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
            else:
                STORE[be.name_of(k)] = data
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            served = [mgr.get(k), mgr.get_layers(k, 0, 1)]
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        self.counts.biggest_parse = max(self.counts.biggest_parse, peak)
        assert peak <= PARSE_BOUND, f"a read of a hostile header took {peak} bytes"
        assert served == [None, None], "a hostile header was served"
        if encoded:
            path.unlink(missing_ok=True)
        else:
            STORE.pop(be.name_of(k), None)
        return False

    def _pins(self, seed: int, encoded: bool, ops: Sequence[int]) -> bool:
        """A mutated pins file decoded with and without the keyring (``encoded``: sealed);
        every 16th example read by a real posix tier's start-up scan. ``True`` when the mutated
        file was accepted (its list is then checked)."""
        from kvplug.backends.posix.pin_store import NotPins, decode_pins
        from kvplug.storage_manager import StorageManager

        auth = self.ring if encoded else None
        pins, text = valid_pins(seed, auth)
        bad = mutate_pins(text, seed, ops, auth)
        accepted = []
        for ring in ((None, auth) if auth is not None else (None,)):
            try:
                got = decode_pins(bad, ring)
            except NotPins:
                continue
            assert all(re.fullmatch(r"[0-9a-f]{2}/[A-Za-z0-9_-][A-Za-z0-9._-]*\.safetensors", p)
                       for p in got), got
            if ring is not None:
                assert got == pins, "a list not sealed with the key was accepted"
            accepted.append(ring)
        self.pins_at += 1
        if self.pins_at % 16 == 0:  # through a real tier's scan: it ends, pins only chunks
            root = self.root / f"pins-{self.pins_at}"
            k = key_of(seed)
            obj = heap_memory_obj((LAYERS, PAGES, PAGE), num_tokens=32)
            header, bufs = cf.encode_chunk(k, obj)
            (root / cf.relative_chunk_path(k)).parent.mkdir(parents=True)
            (root / cf.relative_chunk_path(k)).write_bytes(header + b"".join(map(bytes, bufs)))
            listed = bad.replace('"pins": [', f'"pins": ["{cf.relative_chunk_path(k)}", ', 1)
            (root / "kvplug-pins.json").write_text(listed, errors="surrogateescape")
            with StorageManager({"chunk_size": 32, "tiers": [{"backend": "posix", "name": "t",
                                 "options": {"path": str(root)}}]}) as mgr:
                assert mgr.backend("t").wait_indexed(30), "the start-up scan did not end"
                assert mgr.stats()["t"]["operator_pinned"] <= 1
        return bool(accepted) and bad != text


# -- the value tier over an in-memory store ---------------------------------------------------
STORE: dict[str, bytes] = {}


def _dict_value_tier():  # noqa: ANN202 - a class made once the backends import
    from kvplug.backends.common.value_io import ValueIO
    from kvplug.backends.common.value_tier import ValueStoreTier
    from kvplug.redact import Redactor

    class DictIO(ValueIO):
        def _exists(self, names):
            return [n in STORE for n in names]

        def _get(self, name):
            v = STORE.get(name)
            limit = self.read_limit()
            return None if v is None else v[: None if limit is None else limit + 1]

        def _get_range(self, name, start, end):
            v = STORE.get(name)
            return None if v is None else v[start:end] or None

        def _set_many(self, items):
            STORE.update(items)
            return [None] * len(items)

        def _delete(self, names):
            for n in names:
                STORE.pop(n, None)

    class DictValueTier(ValueStoreTier):
        kind = "in-memory store"

        def open_io(self, ctx, breaker):
            return DictIO(ctx.name, breaker, Redactor("", {})), "memory://"

    return DictValueTier


DictValueTier = _dict_value_tier()
