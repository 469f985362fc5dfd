"""The codec contract: how a chunk's pages become bytes for a slow tier, and back.

A codec works on one layer of one chunk at a time (``[num_blocks, page_bytes]`` uint8 pages), so
a tier that reads layer ranges (``get_layers``) still serves layer-wise loads: each layer is one
self-describing frame (:mod:`kvplug.codecs.frame`). A third-party codec is a subclass of
:class:`Codec` declared under the ``kvplug.codecs`` entry-point group::

    [project.entry-points."kvplug.codecs"]
    mycodec = "my_pkg:MyCodec"

* ``encode_layer`` is an instance method: the instance was built from the tier's
  ``codec_options`` (validated by the class's ``Options`` pydantic model when it has one).
* ``decode_layer`` is a **classmethod**: it may use only the bytes and the ``params`` that
  ``encode_layer`` returned (recorded in the frame), so any reader decodes what any writer wrote,
  whatever options the reader was configured with.
* Anything wrong while decoding (sizes, parameters, a payload that does not decompress) raises:
  the wrapper turns it into a miss. Never fill ``out`` with bytes you are not sure of — a decode
  that returns normally is trusted to be what was encoded (lossless) or its stated approximation.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..keys import CacheKey

_LAYOUT_RE = re.compile(r"^(?P<order>[LBHNC]{5})-bs(?P<bs>[0-9]+)$")


@dataclass(frozen=True)
class LayerSpec:
    """What a codec knows about the layer it encodes or decodes.

    Attributes:
        key: the chunk's key (``kv_dtype`` and ``kv_layout`` say what the page bytes are).
        layer: index of the layer within the chunk object.
        num_blocks: pages (engine blocks) in the layer.
        page_bytes: bytes of one page.
    """

    key: CacheKey
    layer: int
    num_blocks: int
    page_bytes: int

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.page_bytes

    @property
    def element_dtype(self) -> torch.dtype | None:
        """The KV element dtype named by the key's ``kv_dtype`` (``bfloat16``, ``float16``...);
        ``None`` when the cache itself is quantized (``bfloat16-fp8_e4m3``) or it is unknown."""
        parts = self.key.kv_dtype.split("-")
        if len(parts) > 1 and "fp8" in self.key.kv_dtype:
            return None
        dtype = getattr(torch, parts[0], None)
        return dtype if isinstance(dtype, torch.dtype) else None

    @property
    def page_order(self) -> tuple[str, int] | None:
        """``(dims, block_size)`` of one page from the key's ``kv_layout`` (``LBHNC-bs128`` ->
        ``("HNC", 128)``: heads, tokens, channels); ``None`` for a layout not of that form."""
        m = _LAYOUT_RE.match(self.key.kv_layout)
        if not m or sorted(m["order"]) != sorted("LBHNC"):
            return None
        return m["order"].replace("L", "").replace("B", ""), int(m["bs"])


class Codec(ABC):
    """Base class of codecs. Subclasses implement the two abstract methods below and may set
    ``lossy``, ``Options`` and override :meth:`describe` (their defaults are declared here)."""

    #: Whether decoding gives back something other than the exact bytes (logged at start-up;
    #: a lossy codec is only ever used where a tier's config names it).
    lossy: ClassVar[bool] = False
    #: A pydantic model of the tier's ``codec_options`` (unknown keys are rejected); default
    #: none: the raw mapping.
    Options: ClassVar[type | None] = None

    def __init__(self, options: Any = None) -> None:
        self.options = options

    def describe(self) -> dict[str, Any]:
        """JSON-able settings recorded in chunk-file headers and shown by ``kvplug inspect``."""
        dump = getattr(self.options, "model_dump", None)
        return dump(mode="json") if dump else dict(self.options or {})

    @abstractmethod
    def encode_layer(self, pages: torch.Tensor, spec: LayerSpec) -> tuple[Any, dict[str, Any]]:
        """Encode one layer: ``pages`` is a borrowed CPU uint8 tensor ``[num_blocks, page_bytes]``.
        Returns ``(payload, params)``: any bytes-like payload and the JSON-able parameters
        :meth:`decode_layer` needs. Raise :class:`~kvplug.errors.CodecError` for input this codec
        does not handle (the chunk is then stored raw, with one log line)."""

    @classmethod
    @abstractmethod
    def decode_layer(cls, payload: memoryview, params: dict[str, Any], out: torch.Tensor,
                     spec: LayerSpec) -> None:
        """Decode ``payload`` into ``out`` (CPU uint8 ``[num_blocks, page_bytes]``, contiguous).
        Raise on anything that does not fit (the read becomes a miss)."""
