"""``lossless``: byte shuffle + zstd (or lz4) through python-blosc2, bit-exact.

KV pages are 16-bit floats whose high (sign/exponent) bytes repeat far more than the mantissa
bytes; blosc2's byte shuffle groups byte ``i`` of every element together before the entropy
coder, which is what makes KV compress at all (measured against plain zstd on real engine KV in
``benchmarks/bench_codecs.py``). One blosc2 chunk per layer; blosc2 releases the GIL.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import ConfigDict, Field

from ..config import BaseOptions
from ..errors import CodecError
from .base import Codec, LayerSpec

_CODECS = ("zstd", "lz4", "lz4hc", "blosclz", "zlib")
_FILTERS = ("shuffle", "bitshuffle", "none")


class LosslessOptions(BaseOptions):
    """``codec_options`` of the ``lossless`` codec."""

    model_config = ConfigDict(extra="forbid")
    cname: Literal["zstd", "lz4", "lz4hc", "blosclz", "zlib"] = Field(
        default="zstd", description="entropy coder inside blosc2")
    clevel: int = Field(default=1, ge=0, le=9, description="compression level (0: store)")
    filter: Literal["shuffle", "bitshuffle", "none"] = Field(
        default="shuffle", description="byte shuffle before the coder")
    nthreads: int = Field(default=1, ge=1, le=64, description="blosc2 threads per layer")


def _blosc2():  # noqa: ANN202 - imported lazily: the dependency is an extra
    try:
        import blosc2
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise CodecError("the lossless codec needs python-blosc2: pip install 'kvplug[codecs]'") \
            from exc
    return blosc2


class LosslessCodec(Codec):
    """Bit-exact compression of KV pages (byte shuffle by element size + zstd/lz4)."""

    lossy = False
    Options = LosslessOptions

    def __init__(self, options: LosslessOptions | None = None) -> None:
        super().__init__(options or LosslessOptions())
        _blosc2()

    def encode_layer(self, pages: torch.Tensor, spec: LayerSpec) -> tuple[Any, dict[str, Any]]:
        b2 = _blosc2()
        o: LosslessOptions = self.options
        dtype = spec.element_dtype
        typesize = dtype.itemsize if dtype is not None else 1
        filt = {"shuffle": b2.Filter.SHUFFLE, "bitshuffle": b2.Filter.BITSHUFFLE,
                "none": b2.Filter.NOFILTER}[o.filter]
        data = pages.contiguous().numpy()
        payload = b2.compress2(data, typesize=typesize, clevel=o.clevel,
                               codec=getattr(b2.Codec, o.cname.upper()), filters=[filt],
                               filters_meta=[0], nthreads=o.nthreads)
        return payload, {"lib": "blosc2", "cname": o.cname, "typesize": typesize}

    @classmethod
    def decode_layer(cls, payload: memoryview, params: dict[str, Any], out: torch.Tensor,
                     spec: LayerSpec) -> None:
        b2 = _blosc2()
        if params.get("lib") != "blosc2":
            raise CodecError(f"lossless frame of library {params.get('lib')!r}, expected blosc2")
        src = bytes(payload)
        try:
            nbytes, cbytes, _ = b2.get_cbuffer_sizes(src)
        except Exception as exc:  # noqa: BLE001 - a damaged blosc2 header
            raise CodecError(f"payload is not a blosc2 chunk: {exc}") from None
        want = out.numel() * out.element_size()
        if nbytes != want or cbytes != len(src):
            raise CodecError(f"blosc2 chunk holds {nbytes} bytes in {cbytes} (payload {len(src)}), "
                             f"the layer needs {want}")
        dst = out.view(torch.uint8).reshape(-1).numpy()
        try:
            b2.decompress2(src, dst=dst)
        except Exception as exc:  # noqa: BLE001 - a corrupt payload
            raise CodecError(f"blosc2 could not decompress the layer: {exc}") from None
