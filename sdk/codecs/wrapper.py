"""The codec wrapper: one pluggy ``wrapper=True`` plugin per tier that encodes what the tier
stores and decodes what it returns, so posix, gds, fsspec and any third-party tier get codecs for
free and no backend knows about them.

* ``batched_submit_put``: each ``KV_PAGES`` object is encoded (one frame per layer,
  :mod:`.frame`) into an ``ENCODED`` heap object, which the backend receives instead (it stores
  it like any other object; a chunk-file tier records the codec in the header). The wrapper drops
  its own reference after the call: a backend keeps what it ``ref_up``'d. A chunk the codec does
  not handle (e.g. ``fp8`` on an already-fp8 cache) is stored raw, with one log line.
* ``get`` / ``batched_get`` / ``get_layers``: an ``ENCODED`` object from the backend is decoded
  into memory from the manager's ``allocate`` (L1's pool, so promotion stays zero-copy) and the
  encoded one released.
  Wrong codec metadata, a truncated or corrupt payload, or a codec that is not installed here is
  a miss (``None``) with one log line per kind, never wrong bytes. The codec a frame names is
  resolved only among installed entry points and the tier's own codec, never imported by the
  stored name (:func:`~.registry.decoder_for`). A plain ``KV_PAGES`` object
  (stored before the codec was configured) passes through.

Every tier gets a wrapper, even one without a codec: it never encodes, but it still decodes a
chunk another deployment stored through a codec into a shared directory or bucket.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence

import torch

from ..chunkfile.checksums import checksum
from ..errors import CodecError, CodecMissingError
from ..hookspecs import hookimpl
from ..keys import CacheKey
from ..logs import LogOnce
from ..memory import MemoryFormat, MemoryObj, MemoryObjMeta
from ..plugins import BackendInfo
from .base import Codec, LayerSpec
from .frame import build_frame, parse_frame
from .registry import decoder_for

logger = logging.getLogger("kvplug.codecs")


def describe_codec(codec: Codec, info: BackendInfo) -> str:
    """Canonical JSON of a codec (what ``MemoryObjMeta.codec`` and chunk headers carry)."""
    return json.dumps({"name": info.name, "package": info.package, "version": info.version,
                       "params": codec.describe()}, sort_keys=True, separators=(",", ":"))


class CodecWrapper:
    """The wrapper of one tier. ``codec``/``info`` are ``None`` on a tier without a codec."""

    def __init__(self, tier: str, codec: Codec | None, info: BackendInfo | None,
                 allocate: Callable[..., MemoryObj | None]) -> None:
        self.tier = tier
        self.codec = codec
        self.info = info
        self.allocate = allocate
        self.description = describe_codec(codec, info) if codec and info else ""
        #: The configured codec: besides installed entry points, the only class that decodes.
        self._own = (type(codec), info) if codec is not None and info is not None else None
        self._log_once = LogOnce(logger)
        self._lock = threading.Lock()
        self.counters: dict[str, float] = {
            "codec_encoded": 0, "codec_raw_bytes": 0, "codec_encoded_bytes": 0,
            "codec_stored_raw": 0, "codec_decoded": 0, "codec_decode_failures": 0,
            "codec_missing": 0, "codec_dropped_puts": 0,
        }

    def _add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.counters[k] += v

    def dropped(self, n: int) -> None:
        """``n`` stores were dropped before encoding (the tier's encoder queue was full)."""
        self._add(codec_dropped_puts=n)
        self._log_once(("dropped",), "tier %r: codec %r cannot keep up with the stores; stores "
                       "beyond the queue are dropped (counted as codec_dropped_puts)",
                       self.tier, self.info.name if self.info else None)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.counters)

    # -- store ----------------------------------------------------------------------------------
    @hookimpl(wrapper=True)
    def batched_submit_put(self, keys: Sequence, objs: Sequence):
        mine: list[MemoryObj] = []
        if self.codec is not None and isinstance(objs, list):
            for i, (key, obj) in enumerate(zip(keys, objs)):
                enc = self.encode(key, obj)
                if enc is not None:
                    objs[i] = enc  # the backend receives the encoded object instead
                    mine.append(enc)
        try:
            return (yield)
        finally:
            for enc in mine:
                enc.ref_down()

    def encode(self, key: CacheKey, obj: MemoryObj) -> MemoryObj | None:
        """The ``ENCODED`` object of a ``KV_PAGES`` chunk (one reference, the caller's), or
        ``None`` when it is stored raw (not KV pages, or the codec declined it)."""
        assert self.codec is not None and self.info is not None
        meta = obj.meta
        if meta.fmt is not MemoryFormat.KV_PAGES or len(meta.shape) < 2:
            return None
        t = obj.tensor
        layers, blocks = meta.shape[0], meta.shape[1]
        pages = (t if t.device.type == "cpu" else t.cpu()).reshape(layers, blocks, -1)
        if pages.dtype != torch.uint8:
            pages = pages.view(torch.uint8).reshape(layers, blocks, -1)
        page_bytes = pages.shape[2]
        frames: list[bytes] = []
        try:
            for i in range(layers):
                spec = LayerSpec(key, i, blocks, page_bytes)
                payload, params = self.codec.encode_layer(pages[i], spec)
                raw = None if self.codec.lossy else checksum(pages[i].contiguous().numpy())
                frames.append(build_frame(self.info.name, self.info.package, self.info.version,
                                          params, blocks, page_bytes, payload, raw))
        except Exception as exc:  # noqa: BLE001 - a codec that declines stores raw
            self._add(codec_stored_raw=1)
            self._log_once(
                ("encode", type(exc).__name__),
                "tier %r: codec %r did not encode a chunk (%s: %s); such chunks are stored raw",
                self.tier, self.info.name, type(exc).__name__, exc)
            return None
        slot = max(len(f) for f in frames)
        out = torch.zeros((layers, 1, slot), dtype=torch.uint8)
        for i, f in enumerate(frames):
            out[i, 0, : len(f)] = torch.frombuffer(bytearray(f), dtype=torch.uint8)
        self._add(codec_encoded=1, codec_raw_bytes=meta.nbytes, codec_encoded_bytes=out.numel())
        return MemoryObj(out, MemoryObjMeta((layers, 1, slot), torch.uint8, MemoryFormat.ENCODED,
                                            meta.num_tokens, self.description))

    # -- retrieve -------------------------------------------------------------------------------
    @hookimpl(wrapper=True)
    def get(self, key):  # noqa: ANN001 - signature fixed by the spec
        obj = yield
        return self.decode(key, obj, 0)

    @hookimpl(wrapper=True)
    def batched_get(self, keys):  # noqa: ANN001 - signature fixed by the spec
        objs = yield
        if objs is None or len(objs) != len(keys):
            return objs  # the StorageManager treats it as a fault (and releases the objects)
        return [self.decode(k, o, 0) for k, o in zip(keys, objs)]

    @hookimpl(wrapper=True)
    def batched_get_nowait(self, keys):  # noqa: ANN001 - signature fixed by the spec
        """A chunk stored through a codec is not decoded here, on the caller's thread: it is
        released and read again by the bounded call, which decodes it (and counts what fails)."""
        objs = yield
        if objs is None or len(objs) != len(keys):
            return objs
        out = []
        for obj in objs:
            if obj is not None and obj.meta.fmt is MemoryFormat.ENCODED:
                obj.ref_down()
                obj = None
            out.append(obj)
        return out

    @hookimpl(wrapper=True)
    def get_layers(self, key, first_layer, num_layers):  # noqa: ANN001
        obj = yield
        return self.decode(key, obj, first_layer)

    def decode(self, key: CacheKey, obj: MemoryObj | None, first_layer: int) -> MemoryObj | None:
        """``obj`` itself unless it is ``ENCODED``; then its decoded ``KV_PAGES`` object (one
        reference, the caller's; ``obj``'s reference is consumed) or ``None`` on any problem."""
        if obj is None or obj.meta.fmt is not MemoryFormat.ENCODED:
            return obj
        try:
            out = self._decode(key, obj, first_layer)
        except CodecMissingError as exc:
            self._add(codec_missing=1)  # logged once per tier: the name is the store's to choose
            self._log_once(("missing",), "tier %r: %s; treated as a miss (further ones are "
                           "counted in stats as codec_missing)", self.tier, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - anything wrong with stored bytes is a miss
            self._add(codec_decode_failures=1)
            self._log_once(
                ("decode", type(exc).__name__),
                "tier %r: a chunk stored through a codec could not be decoded (%s: %s); treated "
                "as a miss (further failures are counted in stats as codec_decode_failures)",
                self.tier, type(exc).__name__, exc)
            return None
        finally:
            obj.ref_down()
        if out is not None:
            self._add(codec_decoded=1)
        return out

    def _decode(self, key: CacheKey, obj: MemoryObj, first_layer: int) -> MemoryObj | None:
        t = obj.tensor
        if t.dim() != 3 or t.dtype != torch.uint8:
            raise CodecError(f"encoded object of shape {tuple(t.shape)} / {t.dtype} is not "
                             "[layers, 1, frame_bytes] uint8")
        if t.device.type != "cpu":
            t = t.cpu()
        frames = [parse_frame(t[i].reshape(-1).numpy()) for i in range(t.shape[0])]
        blocks, page_bytes = frames[0].blocks, frames[0].page_bytes
        if any((f.blocks, f.page_bytes, f.codec) != (blocks, page_bytes, frames[0].codec)
               for f in frames):
            raise CodecError("the layers of one chunk disagree on codec or page geometry")
        cls = decoder_for(frames[0].codec, frames[0].package, frames[0].version, self._own)
        out = self.allocate((len(frames), blocks, page_bytes), torch.uint8, MemoryFormat.KV_PAGES,
                            obj.num_tokens)
        if out is None:
            return None  # no memory: a miss, as for any read
        try:
            dest = out.tensor.view(torch.uint8).reshape(len(frames), blocks, page_bytes)
            for i, f in enumerate(frames):
                spec = LayerSpec(key, first_layer + i, blocks, page_bytes)
                cls.decode_layer(f.payload, f.params, dest[i], spec)
                if f.raw_xxh3 is not None and checksum(dest[i].numpy()) != f.raw_xxh3:
                    raise CodecError(f"layer {first_layer + i} decoded to other bytes than were "
                                     "encoded (raw checksum mismatch)")
        except BaseException:
            out.ref_down()
            raise
        return out
