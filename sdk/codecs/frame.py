"""One layer of an ``ENCODED`` chunk: a self-describing codec frame.

An ``ENCODED`` memory object is ``[layers, 1, frame_bytes]`` uint8; row ``i`` holds layer ``i``'s
frame, zero padded to the longest frame of the chunk (so a file tier keeps equal, aligned layer
slots and reads one layer with one ranged read)::

    [0, 4)          magic b"KVCF"
    [4, 8)          u32 little-endian J: length of the JSON description
    [8, 16)         u64 little-endian P: length of the payload
    [16, 16 + J)    JSON: codec (name), package, version, params, blocks, page_bytes,
                    payload_xxh3 (of the payload) and, for a lossless codec, raw_xxh3 (of the
                    layer's original bytes, checked after decoding)
    [16 + J, +P)    the codec's payload
    ...             zeros up to frame_bytes

The digests make a frame safe on any tier, even one that keeps no checksums of its own: a
damaged payload is caught before decoding, a lossless decode that is not bit-exact after it.
Every frame names its codec, so any tier's reader can decode it (or say which package is
missing) without the file header; the chunk file's header records the same codec for tools.
Nothing is unpickled; every length is bounded by the slot before it is used.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from ..chunkfile.checksums import checksum
from ..errors import CodecError

MAGIC = b"KVCF"
_HEAD = struct.Struct("<4sIQ")
#: Upper bound of a frame's JSON description.
MAX_DESCRIPTION = 64 << 10


@dataclass(frozen=True)
class Frame:
    """A parsed frame: what :func:`parse_frame` checked."""

    codec: str
    package: str
    version: str
    params: dict[str, Any]
    blocks: int
    page_bytes: int
    payload: memoryview
    raw_xxh3: str | None = None


def build_frame(codec: str, package: str, version: str, params: dict[str, Any], blocks: int,
                page_bytes: int, payload: Any, raw_xxh3: str | None = None) -> bytes:
    """The bytes of one frame (unpadded)."""
    body = memoryview(payload).cast("B")
    doc = {"codec": codec, "package": package, "version": version, "params": params,
           "blocks": blocks, "page_bytes": page_bytes, "payload_xxh3": checksum(body)}
    if raw_xxh3 is not None:
        doc["raw_xxh3"] = raw_xxh3
    desc = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return _HEAD.pack(MAGIC, len(desc), len(body)) + desc + bytes(body)


def _count(doc: dict, name: str) -> int:
    value = doc.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CodecError(f"frame field {name}={value!r} is not a size")
    return value


def parse_frame(slot: Any) -> Frame:
    """Parse and bound-check one layer slot (a frame plus zero padding). Raises
    :class:`~kvplug.errors.CodecError` for anything that is not a whole, well-formed frame."""
    view = memoryview(slot).cast("B")
    if len(view) < _HEAD.size:
        raise CodecError(f"frame slot of {len(view)} bytes is shorter than a frame head")
    magic, jlen, plen = _HEAD.unpack_from(view, 0)
    if magic != MAGIC:
        raise CodecError(f"frame magic {bytes(magic)!r} is not {MAGIC!r}")
    if jlen > MAX_DESCRIPTION or _HEAD.size + jlen + plen > len(view):
        raise CodecError(f"frame lengths ({jlen} + {plen}) overrun its slot of {len(view)} bytes")
    try:
        doc = json.loads(bytes(view[_HEAD.size : _HEAD.size + jlen]))
    except (ValueError, UnicodeDecodeError):
        raise CodecError("frame description is not JSON") from None
    if not isinstance(doc, dict):
        raise CodecError("frame description is not a JSON object")
    names = [doc.get(k) for k in ("codec", "package", "version")]
    if not all(isinstance(n, str) for n in names) or not names[0]:
        raise CodecError(f"frame names no codec ({names!r})")
    if not isinstance(doc.get("params"), dict):
        raise CodecError("frame params are not a JSON object")
    start = _HEAD.size + jlen
    payload = view[start : start + plen]
    if doc.get("payload_xxh3") != checksum(payload):
        raise CodecError("frame payload does not match its checksum (corrupt or truncated)")
    raw = doc.get("raw_xxh3")
    if raw is not None and not isinstance(raw, str):
        raise CodecError(f"frame raw_xxh3={raw!r} is not a digest")
    return Frame(names[0], names[1], names[2], doc["params"], _count(doc, "blocks"),
                 _count(doc, "page_bytes"), payload, raw)
