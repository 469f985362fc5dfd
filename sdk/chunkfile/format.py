"""The chunk file format shared by the posix, gds and fsspec tiers: one safetensors file per chunk.

Layout (all offsets absolute from the start of the file)::

    [0, 8)             u64 little-endian N: length of the JSON header (safetensors)
    [8, 8 + N)         JSON header, space padded so that ``8 + N`` is a multiple of ``ALIGN``
    header_bytes + i * layer_stride      "layer.i"  U8 [num_blocks, page_bytes]
    ... + layer_nbytes                   "_pad.i"   U8 [layer_stride - layer_nbytes] (if needed)

``layer_stride = align_up(layer_nbytes, ALIGN)``, so every layer starts 4 KiB-aligned (one aligned
read per layer, as GPUDirect Storage and O_DIRECT need) and the file size is a multiple of
``ALIGN``. Any safetensors reader opens the file (``safetensors.safe_open``): tensor data is
contiguous, padding lives in tiny ``_pad.i`` tensors.

``__metadata__`` (all strings) names the key fields, the object's shape/dtype/format, the token
count, the format version, one xxh3_64 checksum per layer (a layer-wise read verifies what it
read) and an xxh3_64 checksum of the padded header itself (computed with ``header_xxh3`` set to
sixteen zeros), so a flipped byte anywhere in the header or in any layer is detected. Nothing is
unpickled; every size is checked against the file size before it is used.

A chunk stored through a codec (:mod:`kvplug.codecs`) is an ``ENCODED`` object: the same layout
with one layer per codec frame (``[layers, 1, frame_bytes]``), and two differences in the header:
a ``codec`` entry (JSON: codec name, package, version, parameters) and the format version
``"1+codec"``. Files written before codecs existed (version ``"1"``, no ``codec``) read exactly
as before; a reader that predates codecs sees another format version: a miss, never bytes. The
layer checksums cover the encoded bytes, so a damaged payload is caught before any decoding.

An *authenticated* chunk (written with a :class:`~.auth.Keyring`, see :mod:`.auth`) has the format
version ``"1+mac"`` (``"1+codec+mac"``), ``checksum_algo`` ``"aes256-gmac"`` with one 32-hex tag
per layer, ``mac_key_id`` and ``mac_salt`` entries, and ``header_mac`` (32 hex) in place of
``header_xxh3``. A reader without a keyring sees another format version (a miss, left in place);
a reader with one refuses any chunk that is not authenticated under one of its keys, and any of
another format version, authenticated or not (:class:`~.auth.AuthError`: nothing a writer
without the secret plants can hold a name against the next store). Its key fields record
:func:`stored_key`: the chunk hash, which anyone computes from a guessed prompt, is replaced by
the chunk's keyed name digest, so no header confirms a guess. Without a keyring nothing here
changes.

An *encrypted* chunk (a keyring made with ``encrypt=True``, see :mod:`.crypt`) has the format
version ``"1+enc"``, ``checksum_algo`` ``"aes256-gcm"`` with one 32-hex GCM tag per layer (its
layers are ciphertext, same sizes, same offsets), ``mac_key_id``, ``mac_salt``, the chunk's
``tenant`` id (also in its name) and ``sealed``: the key fields, shape, dtype, memory format,
token count and codec, encrypted. Only the geometry stays readable (``num_layers``,
``num_blocks``, ``page_bytes``: the tensor table shows it anyway). The header is authenticated
by ``header_mac`` as above. A keyring that encrypts refuses every chunk that is not encrypted (a
downgrade); one that does not refuses encrypted chunks (no MAC suffix).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import operator
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import ChunkFormatError, ChunkVersionError, ConfigError
from ..keys import CacheKey
from ..memory import MemoryFormat, MemoryObj, MemoryObjMeta
from .auth import MAC_ALGO, TAG_HEX
from .checksums import CHECKSUM_ALGO, checksum, layer_sums, split_layers
from .crypt import ENC_ALGO, ENC_VERSION_SUFFIX, TAG_BYTES, ChunkCipher

if TYPE_CHECKING:  # pragma: no cover
    from .auth import ChunkMac, Keyring

FORMAT_NAME = "kvplug-chunk"
FORMAT_VERSION = "1"
#: Suffix of the format version of a chunk stored through a codec (``"1+codec"``).
CODEC_VERSION_SUFFIX = "+codec"
#: Suffix of the format version of an authenticated chunk (``"1+mac"``, ``"1+codec+mac"``).
MAC_VERSION_SUFFIX = "+mac"
ALIGN = 4096
#: Reading this many leading bytes gives :func:`header_size`; headers of up to ~60 layers fit in
#: it entirely (check ``header_size(prefix) <= len(prefix)`` and read the rest otherwise).
HEADER_PROBE = 4096
#: Upper bound accepted for a header (length prefix, JSON, padding) where no engine's geometry
#: bounds it (``kvplug inspect``, the SDK on its own): a chunk of some 4,000 layers. A corrupt
#: length is rejected before any read.
MAX_HEADER = 1 << 20
#: Header bytes besides its layers' entries: the fixed metadata, the key fields (model name,
#: dtype, layout, digests, tenant) and a codec's description, with room to spare (about 1 KiB
#: is used).
HEADER_BASE = 8 << 10
#: Header bytes per layer: two tensor entries with their offsets and shape (pages, page bytes),
#: and a checksum or a tag, with room to spare (about 210 are used).
HEADER_PER_LAYER = 256
_HDR_CK_FIELD = "header_xxh3"
_ZERO_CK = "0" * 16
_HDR_MAC_FIELD = "header_mac"
_ZERO_MAC = "0" * TAG_HEX
_ZEROS = memoryview(bytes(ALIGN))

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "bool",
        "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


_LAYERED = (MemoryFormat.KV_PAGES, MemoryFormat.ENCODED)


def format_version(encoded: bool, mac: bool = False) -> str:
    """The format version written for a plain chunk, or for one stored through a codec (and
    for an authenticated one: ``+mac``)."""
    out = FORMAT_VERSION + CODEC_VERSION_SUFFIX if encoded else FORMAT_VERSION
    return out + MAC_VERSION_SUFFIX if mac else out


def _version(encoded: bool, mac: bool) -> str:
    """:func:`format_version`, asked with one argument for a plain chunk (so a test that
    stands in an older format_version(encoded) still sees the plain format unchanged)."""
    return format_version(encoded, True) if mac else format_version(encoded)


def chunk_layout(meta: MemoryObjMeta) -> tuple[int, int, int]:
    """``(num_layers, num_blocks, page_bytes)`` of an object: a ``KV_PAGES`` or ``ENCODED``
    object of 2+ dims is ``[layers, blocks, ...]``; anything else is one layer of one block."""
    if meta.fmt in _LAYERED and len(meta.shape) >= 2:
        layers, blocks = meta.shape[0], meta.shape[1]
    else:
        layers, blocks = 1, 1
    pages = layers * blocks
    page_bytes = meta.nbytes // pages if pages else 0
    return layers, blocks, page_bytes


@dataclasses.dataclass(frozen=True)
class ChunkHeader:
    """Everything :func:`decode_header` learned (and checked) about one chunk file."""

    key: CacheKey
    num_layers: int
    num_blocks: int
    page_bytes: int
    num_tokens: int
    kv_layout: str
    kv_dtype: str
    data_offsets: list[int]  # absolute file offset of each layer
    layer_nbytes: int
    checksums: list[str]
    file_size: int
    header_bytes: int  # where layer 0 starts (a multiple of ALIGN)
    shape: tuple[int, ...]
    dtype: torch.dtype
    fmt: MemoryFormat
    version: str = FORMAT_VERSION
    #: Canonical JSON of the codec of an ``ENCODED`` chunk (name, package, version, params);
    #: empty for a plain chunk.
    codec: str = ""
    #: The MACs of an authenticated chunk (:class:`~.auth.ChunkMac`): ``checksums`` are its
    #: layer tags and :func:`~.checksums.verify_layer` checks them; ``None`` for a plain chunk.
    #: An encrypted chunk's :class:`~.crypt.ChunkCipher`: its layer tags are GCM tags, and
    #: verifying a layer decrypts it in place.
    mac: ChunkMac | ChunkCipher | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def codec_info(self) -> dict:
        """The codec description as a dict (empty for a plain chunk)."""
        return json.loads(self.codec) if self.codec else {}

    @property
    def layer_stride(self) -> int:
        return align_up(self.layer_nbytes)

    @property
    def nbytes(self) -> int:
        """Payload bytes (what the memory object holds)."""
        return self.num_layers * self.layer_nbytes

    @functools.cached_property
    def meta(self) -> MemoryObjMeta:
        """The meta of the object the chunk's bytes fill (made once per header: a header is
        kept and reused for every read of its file, and the meta is immutable)."""
        return MemoryObjMeta(self.shape, self.dtype, self.fmt, self.num_tokens, self.codec)

    def layers_meta(self, first_layer: int, num_layers: int) -> MemoryObjMeta:
        """Meta of an object holding layers ``[first_layer, first_layer + num_layers)``."""
        if self.fmt not in _LAYERED or len(self.shape) < 2:
            raise ChunkFormatError(f"layer ranges need a KV_PAGES chunk of 2+ dims ({self.shape})")
        check_layer_range(self, first_layer, num_layers)
        return MemoryObjMeta((num_layers, *self.shape[1:]), self.dtype, self.fmt, self.num_tokens,
                             self.codec)

    def select(self, layers: tuple[int, int] | None) -> tuple[int, int, MemoryObjMeta]:
        """``(first, count, meta)`` of a read of ``layers`` (``None``: the whole chunk). A range
        the chunk does not have is the caller's mistake: ``ValueError``."""
        if layers is None:
            return 0, self.num_layers, self.meta
        first, count = layers
        try:
            return first, count, self.layers_meta(first, count)
        except ChunkFormatError as exc:
            raise ValueError(str(exc)) from None


def check_layer_range(header: ChunkHeader, first_layer: int, num_layers: int) -> None:
    if first_layer < 0 or num_layers < 1 or first_layer + num_layers > header.num_layers:
        raise ChunkFormatError(
            f"layers [{first_layer}, {first_layer + num_layers}) out of range for a chunk of "
            f"{header.num_layers} layers"
        )


#: How every header's JSON starts: the metadata object comes first (then the tensor table).
_BODY_OPEN = '{"__metadata__":'
_JSON = json.JSONDecoder()


@functools.lru_cache(maxsize=256)
def _tensor_table(layers: int, blocks: int, page_bytes: int) -> str:
    """The JSON after a header's metadata: the tensor entries and the closing brace (the same
    for every chunk of one layout, so it is built once per layout)."""
    layer_nbytes = blocks * page_bytes
    stride = align_up(layer_nbytes)
    tensors: dict[str, object] = {}
    for i in range(layers):
        base = i * stride
        tensors[f"layer.{i}"] = {
            "dtype": "U8", "shape": [blocks, page_bytes],
            "data_offsets": [base, base + layer_nbytes],
        }
        if stride != layer_nbytes:
            tensors[f"_pad.{i}"] = {
                "dtype": "U8", "shape": [stride - layer_nbytes],
                "data_offsets": [base + layer_nbytes, base + stride],
            }
    table = json.dumps(tensors, separators=(",", ":"))  # "{...}": its entries follow a comma
    return ("," + table[1:]) if tensors else "}"


def stored_key(key: CacheKey, auth: Keyring | None = None) -> CacheKey:
    """The key a chunk's header records for ``key``: ``key`` itself without a keyring; with
    one, ``key`` with its ``chunk_hash`` *veiled*: replaced by the keyed digest that names the
    chunk (:meth:`~.auth.Keyring.name_digest` of the key string, 32 bytes). A chunk hash is
    computable from a guessed prompt, so a header recording it would let any reader of the
    store confirm the guess. Writers encode this key (the MAC is bound to it) and every reader
    compares a header's key with it: the one place of the rule."""
    if auth is None:
        return key
    return key.with_hash(bytes.fromhex(auth.name_digest(key.to_string())))


def holds(header: ChunkHeader, key: CacheKey, auth: Keyring | None = None) -> bool:
    """Whether a checked ``header`` is ``key``'s chunk (the key it records is
    :func:`stored_key`). With a keyring, names are keyed: a chunk of another key (another
    prompt's, another tenant's) under this key's name was put there by hand, a replay, so it is
    counted as an authentication failure. Every reader asks this before reading a layer."""
    if header.key == stored_key(key, auth):
        return True
    if auth is not None:
        auth.failed("the chunk holds another key (replayed under this name)")
    return False


def encode_header(key: CacheKey, meta: MemoryObjMeta, checksums: Sequence[str],
                  mac: ChunkMac | None = None) -> bytes:
    """The padded header (length prefix + JSON) of a chunk holding ``meta``'s bytes; with
    ``mac``, an authenticated one (``checksums`` are then its layer tags). ``key`` is recorded
    as given: an authenticated writer passes :func:`stored_key` (and seals the MAC to it)."""
    if meta.dtype not in _DTYPE_NAMES:
        raise ConfigError(f"dtype {meta.dtype} cannot be stored in a chunk file")
    encoded = meta.fmt is MemoryFormat.ENCODED
    if encoded != bool(meta.codec):
        raise ValueError(f"a {meta.fmt.value} object with codec={meta.codec!r}: an ENCODED object "
                         "names its codec, any other object names none")
    layers, blocks, page_bytes = chunk_layout(meta)
    if len(checksums) != layers:
        raise ValueError(f"{len(checksums)} checksums for {layers} layers")
    field_name, zero = (_HDR_MAC_FIELD, _ZERO_MAC) if mac is not None else (_HDR_CK_FIELD,
                                                                            _ZERO_CK)
    if mac is None:
        meta_json = _plain_metadata_json(key, meta, checksums)
    elif isinstance(mac, ChunkCipher):
        meta_json = json.dumps(_sealed_metadata(key, meta, checksums, mac), separators=(",", ":"))
    else:
        meta_json = json.dumps(_readable_metadata(key, meta, checksums, mac, field_name, zero),
                               separators=(",", ":"))
    body = (_BODY_OPEN + meta_json + _tensor_table(layers, blocks, page_bytes)).encode()
    total = align_up(8 + len(body))
    raw = bytearray(struct.pack("<Q", total - 8) + body + b" " * (total - 8 - len(body)))
    digest = (checksum(raw) if mac is None else mac.header_tag(bytes(raw))).encode()
    at = raw.index(f'"{field_name}":"{zero}"'.encode()) + len(field_name) + 4
    raw[at : at + len(zero)] = digest
    return bytes(raw)


def _readable_metadata(key: CacheKey, meta: MemoryObjMeta, checksums: Sequence[str],
                       mac: ChunkMac | None, field_name: str, zero: str) -> dict[str, str]:
    """The ``__metadata__`` of a plain or authenticated chunk: every field readable."""
    encoded = meta.fmt is MemoryFormat.ENCODED
    layers, blocks, page_bytes = chunk_layout(meta)
    return {
        field_name: zero,
        "format": FORMAT_NAME,
        "format_version": _version(encoded, mac is not None),
        **key.fields(),
        "num_layers": str(layers),
        "num_blocks": str(blocks),
        "page_bytes": str(page_bytes),
        "num_tokens": str(meta.num_tokens),
        "shape": _json_ints(meta.shape),
        "dtype": _DTYPE_NAMES[meta.dtype],
        "fmt": meta.fmt.value,
        **({"codec": meta.codec} if encoded else {}),
        **({"mac_key_id": mac.key_id, "mac_salt": mac.salt.hex()} if mac is not None else {}),
        "checksum_algo": CHECKSUM_ALGO if mac is None else MAC_ALGO,
        "checksums": _json_hex_list(checksums) if mac is None else json.dumps(list(checksums)),
    }


#: Stand-ins for the chunk hash and the checksums while a metadata template is dumped (control
#: characters: JSON writes them as ``"\u0001"`` and ``"\u0002"``; a template is kept only where
#: each of the two texts occurs once)
_HASH_MARK, _SUMS_MARK = "\x01", "\x02"
#: plain chunks' metadata JSON around the chunk hash and the checksums, by everything else in it
#: (:func:`_plain_metadata_json`); emptied when full
_METADATA_TEXT: dict[tuple, tuple[str, str, str] | None] = {}
_METADATA_TEXT_MAX = 256
#: every field of a key but its chunk hash, as a tuple: what a template is kept by (read from the
#: dataclass, so a field added to :class:`CacheKey` is part of it too)
_key_but_hash = operator.attrgetter(
    *(f.name for f in dataclasses.fields(CacheKey) if f.name != "chunk_hash"))


def _plain_metadata_json(key: CacheKey, meta: MemoryObjMeta, checksums: Sequence[str]) -> str:
    """``json.dumps`` of a plain chunk's metadata (:func:`_readable_metadata`), the same text,
    from a template per engine configuration and layout: the chunks of one differ only in their
    hash and checksums, and the metadata is encoded on every store and every header parse."""
    sums = _json_hex_list(checksums)
    ident = (_key_but_hash(key), meta, _version(meta.fmt is MemoryFormat.ENCODED, False))
    try:
        parts = _METADATA_TEXT[ident]
    except KeyError:
        if len(_METADATA_TEXT) >= _METADATA_TEXT_MAX:
            _METADATA_TEXT.clear()
        parts = _METADATA_TEXT[ident] = _metadata_template(key, meta)
    except TypeError:  # a meta that cannot be a dict key (a shape given as a list)
        parts = None
    if parts is None or not (sums.isascii() and sums.isprintable()) or "\\" in sums:
        return json.dumps(_readable_metadata(key, meta, checksums, None, _HDR_CK_FIELD, _ZERO_CK),
                          separators=(",", ":"))
    before, between, after = parts
    # a string of printable ASCII without a backslash: JSON escapes only its quotes
    return before + '"' + key.hex + '"' + between + '"' + sums.replace('"', '\\"') + '"' + after


def _metadata_template(key: CacheKey, meta: MemoryObjMeta) -> tuple[str, str, str] | None:
    """The metadata JSON of ``key``'s configuration and ``meta`` cut around its chunk hash and
    checksums (in that order), or None where the stand-ins are not found once each."""
    metadata = _readable_metadata(key, meta, [], None, _HDR_CK_FIELD, _ZERO_CK)
    metadata["chunk_hash"], metadata["checksums"] = _HASH_MARK, _SUMS_MARK
    text = json.dumps(metadata, separators=(",", ":"))
    hash_text, sums_text = json.dumps(_HASH_MARK), json.dumps(_SUMS_MARK)
    if text.count(hash_text) != 1 or text.count(sums_text) != 1:
        return None
    before, rest = text.split(hash_text)
    if sums_text not in rest:  # the checksums before the hash: not the order filled in
        return None
    between, after = rest.split(sums_text)
    return before, between, after


def _json_ints(values: Sequence[int]) -> str:
    """``json.dumps(list(values))``, the same text, built directly for plain ints (a header is
    encoded on every store, and again to check every header read)."""
    if all(type(v) is int for v in values):
        return "[" + ", ".join(map(str, values)) + "]"
    return json.dumps(list(values))


def _json_hex_list(digests: Sequence[str]) -> str:
    """``json.dumps(list(digests))``, the same text, built directly for strings with nothing
    to escape (the xxh3 digests a writer makes; a header read from a file may hold anything)."""
    try:
        text = '["' + '", "'.join(digests) + '"]' if digests else "[]"
    except TypeError:  # not all strings
        return json.dumps(list(digests))
    if text.isascii() and text.isprintable() and "\\" not in text and \
            text.count('"') == 2 * len(digests):
        return text
    return json.dumps(list(digests))


def _sealed_metadata(key: CacheKey, meta: MemoryObjMeta, checksums: Sequence[str],
                     cipher: ChunkCipher) -> dict[str, str]:
    """The ``__metadata__`` of an encrypted chunk: the key fields and the object's meta sealed
    (``sealed``), the geometry, the key id, salt and tenant readable (what decrypting needs)."""
    layers, blocks, page_bytes = chunk_layout(meta)
    veiled = {**key.fields(), "num_tokens": str(meta.num_tokens),
              "shape": json.dumps(list(meta.shape)), "dtype": _DTYPE_NAMES[meta.dtype],
              "fmt": meta.fmt.value, "codec": meta.codec}
    return {
        _HDR_MAC_FIELD: _ZERO_MAC,
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION + ENC_VERSION_SUFFIX,
        "num_layers": str(layers),
        "num_blocks": str(blocks),
        "page_bytes": str(page_bytes),
        "mac_key_id": cipher.key_id,
        "mac_salt": cipher.salt.hex(),
        "tenant": cipher.tenant,
        "sealed": cipher.seal_fields(json.dumps(veiled, separators=(",", ":")).encode()),
        "checksum_algo": ENC_ALGO,
        "checksums": json.dumps(list(checksums)),
    }


def _unseal(meta: dict[str, str], auth: Keyring) -> tuple[dict[str, str], ChunkCipher]:
    """An encrypted chunk's metadata with its sealed fields opened, and its cipher;
    :class:`~.auth.AuthError` (counted) for any chunk that is not encrypted under the ring."""
    version = meta.get("format_version")
    if version != FORMAT_VERSION + ENC_VERSION_SUFFIX:
        raise auth.failure(f"chunk of format version {version!r} is not encrypted")
    tenant = meta.get("tenant", "")
    if len(tenant) not in (0, 16) or not all(c in "0123456789abcdef" for c in tenant):
        raise auth.failure("chunk names a malformed tenant")
    cipher = auth.cipher(meta.get("mac_key_id", ""), meta.get("mac_salt", ""), tenant)
    try:
        veiled = json.loads(cipher.open_fields(meta.get("sealed", "")))
    except (ValueError, RecursionError):
        veiled = None
    if not isinstance(veiled, dict) or not all(isinstance(v, str) for v in veiled.values()) \
            or veiled.get("tenant", "") != tenant:
        raise auth.failure("the header's sealed fields are malformed")
    opened = {k: v for k, v in veiled.items() if k != "codec" or v}
    return {**meta, **opened}, cipher


def encode_chunk(key: CacheKey, obj: MemoryObj,
                 auth: Keyring | None = None) -> tuple[bytes, list[memoryview]]:
    """Header bytes and the buffers to write after it, in order (layers and padding); with
    ``auth`` (the tier's keyring), an authenticated chunk.

    The layer buffers are zero-copy views of ``obj`` (a CPU object): keep ``obj`` referenced until
    they are written. ``header + b"".join(buffers)`` is the whole file.
    """
    header, bufs, _ = encode_chunk_with_header(key, obj, auth)
    return header, bufs


def layer_checksums(obj: MemoryObj, mac: ChunkMac | None = None) -> list[str]:
    """One checksum per layer of ``obj`` (a CPU object); with ``mac``, one tag per layer."""
    return layer_sums(split_layers(obj.byte_view.numpy(), chunk_layout(obj.meta)[0]), mac)


def encode_chunk_with_header(
    key: CacheKey, obj: MemoryObj, auth: Keyring | None = None
) -> tuple[bytes, list[memoryview], ChunkHeader]:
    """:func:`encode_chunk` plus the :class:`ChunkHeader` describing the file (no parsing);
    with ``auth`` the header records :func:`stored_key` (and so does the returned header)."""
    key = stored_key(key, auth)
    layer_views = split_layers(obj.byte_view.numpy(), chunk_layout(obj.meta)[0])
    mac = auth.seal(key) if auth is not None else None
    if isinstance(mac, ChunkCipher):  # the file holds ciphertext: written from a buffer of it
        n = len(layer_views[0]) if layer_views else 0
        cipher_text = np.empty(n * len(layer_views) + TAG_BYTES, dtype=np.uint8)
        sums = mac.encrypt_layers(layer_views, cipher_text)
        layer_views = split_layers(cipher_text[: n * len(layer_views)], len(layer_views))
    else:
        sums = layer_sums(layer_views, mac)
    header = encode_header(key, obj.meta, sums, mac)
    pad = align_up(len(layer_views[0])) - len(layer_views[0]) if layer_views else 0
    bufs: list[memoryview] = ([b for v in layer_views for b in (v, _ZEROS[:pad])] if pad
                              else list(layer_views))
    return header, bufs, make_header(key, obj.meta, sums, len(header), mac)


def max_header_bytes(num_layers: int) -> int:
    """The most bytes the header of a chunk of at most ``num_layers`` layers takes (what an
    engine whose chunks have that many layers accepts, before reading or parsing any of it)."""
    return min(MAX_HEADER, align_up(8 + HEADER_BASE + HEADER_PER_LAYER * max(1, num_layers)))


def header_size(prefix8: bytes | memoryview, max_header: int | None = None) -> int:
    """Bytes of header (length prefix + JSON + padding) announced by a file's first 8 bytes; at
    most ``max_header`` (:func:`max_header_bytes` of the engine's layers; ``None``:
    :data:`MAX_HEADER`), else :class:`ChunkFormatError` before anything more is read."""
    if len(prefix8) < 8:
        raise ChunkFormatError(f"chunk file shorter than 8 bytes ({len(prefix8)})")
    (n,) = struct.unpack_from("<Q", prefix8, 0)
    total = 8 + n
    if n < 2 or total > MAX_HEADER or total % ALIGN:
        raise ChunkFormatError(f"header length {n} is not a valid kvplug chunk header length")
    if max_header is not None and total > max_header:
        raise ChunkFormatError(f"header of {total} bytes is longer than the {max_header} a chunk "
                               "of this engine has")
    return total


def _int(meta: dict[str, str], name: str, minimum: int = 0) -> int:
    value = meta.get(name)
    if not isinstance(value, str) or not value.isdigit() or len(value) > 18:
        raise ChunkFormatError(f"metadata {name}={value!r} is not a non-negative integer")
    out = int(value)
    if out < minimum:
        raise ChunkFormatError(f"metadata {name}={out} is below {minimum}")
    return out


def _json_list(meta: dict[str, str], name: str) -> list:
    try:
        value = json.loads(meta.get(name, ""))
    except (ValueError, TypeError, RecursionError):  # RecursionError: deeply nested JSON
        raise ChunkFormatError(f"metadata {name} is not JSON") from None
    if not isinstance(value, list):
        raise ChunkFormatError(f"metadata {name} is not a list")
    return value


def _metadata(raw: bytes) -> object:
    """The ``__metadata__`` object of a header. Only the metadata is parsed, and only when the
    JSON starts as every writer starts it: the rest (the tensor table, the padding) is checked
    byte for byte against the canonical encoding by :func:`decode_header` anyway, and a header
    that starts otherwise can never pass that check, so it is refused unparsed. What is parsed
    is bounded by the header's length (:func:`header_size`)."""
    if not raw.startswith(_BODY_OPEN.encode(), 8):
        raise ChunkFormatError("header does not start as a kvplug chunk header's JSON")
    try:
        return _JSON.raw_decode(raw[8:].decode("utf-8"), len(_BODY_OPEN))[0]
    except (ValueError, RecursionError) as exc:  # RecursionError: deeply nested JSON
        raise ChunkFormatError(f"header is not valid JSON: {exc}") from None


def decode_header(prefix: bytes | memoryview, file_size: int | None = None,
                  auth: Keyring | None = None, max_header: int | None = None) -> ChunkHeader:
    """Parse and check a chunk header from the file's leading bytes (at least
    :func:`header_size` of them; at most ``max_header``, see there). Raises
    :class:`ChunkFormatError` on anything wrong: length,
    JSON, header checksum, format version, key fields, layout, or a ``file_size`` that differs
    from what the header implies. With ``auth`` (a keyring), the chunk must be authenticated
    under one of its keys: anything else is an :class:`~.auth.AuthError` (counted there), and
    the header returned verifies its layers by their tags."""
    total = header_size(prefix, max_header)
    if len(prefix) < total:
        raise ChunkFormatError(f"need {total} header bytes, got {len(prefix)}")
    if file_size is not None and file_size < total:
        raise ChunkFormatError(f"file of {file_size} bytes is shorter than its header ({total})")
    raw = bytes(prefix[:total])
    meta = _metadata(raw)
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ChunkFormatError("header has no string-valued __metadata__")
    if meta.get("format") != FORMAT_NAME:
        raise ChunkFormatError(f"format {meta.get('format')!r} is not {FORMAT_NAME!r}")
    cipher = None
    if auth is not None and auth.encrypts:  # the sealed fields opened, the version checked
        meta, cipher = _unseal(meta, auth)
    encoded = "codec" in meta
    version = meta.get("format_version")
    if cipher is None and auth is not None and version != _version(encoded, True):
        # under a keyring, an entry that is not an authenticated chunk of this version is an
        # authentication failure (deleted, replaced by the next store), never "another
        # version's, left in place": a writer without the secret would squat every name
        mac = isinstance(version, str) and version.endswith(MAC_VERSION_SUFFIX)
        raise auth.failure(f"chunk of format version {version!r} " + (
            f"is not this version's ({_version(encoded, True)!r})" if mac else "carries no MAC"))
    if cipher is None and version != _version(encoded, auth is not None):
        raise ChunkVersionError(
            f"format version {version!r} is not {_version(encoded, auth is not None)!r}"
        )
    try:
        key = CacheKey.from_fields(meta)
    except ConfigError as exc:
        raise ChunkFormatError(f"bad key fields: {exc}") from None
    layers = _int(meta, "num_layers")
    blocks = _int(meta, "num_blocks")
    page_bytes = _int(meta, "page_bytes")
    num_tokens = _int(meta, "num_tokens")
    shape = _json_list(meta, "shape")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ChunkFormatError(f"shape {shape!r} is not a list of sizes")
    dtype = _DTYPES.get(meta.get("dtype", ""))
    if dtype is None:
        raise ChunkFormatError(f"dtype {meta.get('dtype')!r} is not supported")
    try:
        fmt = MemoryFormat(meta.get("fmt"))
    except ValueError:
        raise ChunkFormatError(f"memory format {meta.get('fmt')!r} is unknown") from None
    codec = meta.get("codec", "")
    if encoded != (fmt is MemoryFormat.ENCODED) or (encoded and not _codec_ok(codec)):
        raise ChunkFormatError(f"codec {codec!r} does not fit memory format {fmt.value!r}")
    obj_meta = MemoryObjMeta(tuple(shape), dtype, fmt, num_tokens, codec)
    if chunk_layout(obj_meta) != (layers, blocks, page_bytes) or obj_meta.nbytes != (
        layers * blocks * page_bytes
    ):
        raise ChunkFormatError("shape/dtype disagree with num_layers/num_blocks/page_bytes")
    sums = _json_list(meta, "checksums")
    algo, width = (CHECKSUM_ALGO, 16) if auth is None else (
        ENC_ALGO if cipher is not None else MAC_ALGO, TAG_HEX)
    if meta.get("checksum_algo") != algo or len(sums) != layers or not all(
        isinstance(s, str) and len(s) == width for s in sums
    ):
        if auth is not None:
            raise auth.failure("layer tags are missing or malformed")
        raise ChunkFormatError("layer checksums are missing or malformed")
    if auth is not None:
        mac = cipher if cipher is not None else auth.opener(
            meta.get("mac_key_id", ""), meta.get("mac_salt", ""), key)
        expect = encode_header(key, obj_meta, sums, mac)
        if expect != raw:
            raise auth.failure("header MAC mismatch or a header not in canonical form")
        head = make_header(key, obj_meta, sums, total, mac)
        if file_size is not None and file_size != head.file_size:
            raise ChunkFormatError(f"file is {file_size} bytes, its header describes "
                                   f"{head.file_size}")
        return head
    # The header must be byte for byte what this module writes for these values: that checks
    # every tensor entry, the padding and the header checksum (an xxh3 of the canonical bytes)
    # in one comparison.
    if encode_header(key, obj_meta, sums) != raw:
        stored = meta.get(_HDR_CK_FIELD, "")
        at = raw.find(f'"{_HDR_CK_FIELD}":"{stored}"'.encode()) + len(_HDR_CK_FIELD) + 4
        if len(stored) != 16 or at < len(_HDR_CK_FIELD) + 4 or checksum(
            raw[:at] + _ZERO_CK.encode() + raw[at + 16 :]
        ) != stored:
            raise ChunkFormatError("header checksum mismatch")
        raise ChunkFormatError("header does not match its own metadata (tensor table)")
    head = make_header(key, obj_meta, sums, total)
    if file_size is not None and file_size != head.file_size:
        raise ChunkFormatError(f"file is {file_size} bytes, its header describes {head.file_size}")
    return head


def _codec_ok(codec: str) -> bool:
    """Whether a header's ``codec`` entry is a JSON object naming a codec."""
    try:
        doc = json.loads(codec)
    except (ValueError, RecursionError):  # RecursionError: deeply nested JSON
        return False
    return isinstance(doc, dict) and isinstance(doc.get("name"), str) and bool(doc["name"])


def make_header(
    key: CacheKey, meta: MemoryObjMeta, checksums: Sequence[str], header_bytes: int,
    mac: ChunkMac | None = None,
) -> ChunkHeader:
    """The :class:`ChunkHeader` of a chunk whose encoded header (:func:`encode_header`) is
    ``header_bytes`` long, without parsing it (writers use it to remember what they wrote)."""
    layers, blocks, page_bytes = chunk_layout(meta)
    layer_nbytes = blocks * page_bytes
    stride = align_up(layer_nbytes)
    return ChunkHeader(
        key=key, num_layers=layers, num_blocks=blocks, page_bytes=page_bytes,
        num_tokens=meta.num_tokens, kv_layout=key.kv_layout, kv_dtype=key.kv_dtype,
        data_offsets=[header_bytes + i * stride for i in range(layers)],
        layer_nbytes=layer_nbytes, checksums=[str(s) for s in checksums],
        file_size=header_bytes + layers * stride, header_bytes=header_bytes,
        shape=tuple(meta.shape), dtype=meta.dtype, fmt=meta.fmt,
        version=FORMAT_VERSION + ENC_VERSION_SUFFIX if isinstance(mac, ChunkCipher)
        else _version(meta.fmt is MemoryFormat.ENCODED, mac is not None),
        codec=meta.codec, mac=mac,
    )


def read_buffers(
    header: ChunkHeader, dest, first_layer: int, num_layers: int, scratch: memoryview
) -> tuple[int, list[memoryview]]:  # noqa: ANN001
    """``(file_offset, buffers)`` for one vectored read (``os.preadv``) of layers
    ``[first_layer, first_layer + num_layers)`` straight into ``dest`` (their bytes, contiguous);
    the padding between layers goes into ``scratch`` (at least ``ALIGN`` bytes, contents junk)."""
    check_layer_range(header, first_layer, num_layers)
    view = memoryview(dest).cast("B")
    n = header.layer_nbytes
    if len(view) != n * num_layers:
        raise ValueError(f"destination holds {len(view)} bytes, layers need {n * num_layers}")
    pad = header.layer_stride - n
    if not pad:
        return header.data_offsets[first_layer], [view]
    bufs: list[memoryview] = []
    for i in range(num_layers):
        bufs.append(view[i * n : (i + 1) * n])
        if i + 1 < num_layers:
            bufs.append(scratch[:pad])
    return header.data_offsets[first_layer], bufs
