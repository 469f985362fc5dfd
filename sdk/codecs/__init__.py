"""Codecs: per-tier compression of chunks, applied by one pluggy wrapper (:mod:`.wrapper`).

* :mod:`.base`     — the :class:`Codec` contract and :class:`LayerSpec`;
* :mod:`.frame`    — the self-describing frame each encoded layer is stored as;
* :mod:`.registry` — discovery through the ``kvplug.codecs`` entry-point group;
* :mod:`.wrapper`  — :class:`CodecWrapper`, registered on every tier by the StorageManager;
* :mod:`.lossless`, :mod:`.fp8` — the reference codecs (``lossless``, ``fp8``).

A tier opts in with ``codec: NAME`` and ``codec_options: {...}`` in its config (see
docs/codecs.md); L1 (a tier that never blocks) keeps raw pages.
"""

from .base import Codec, LayerSpec
from .frame import Frame, build_frame, parse_frame
from .registry import ENTRY_POINT_GROUP, decoder_for, discover_codecs, load_codec_class
from .wrapper import CodecWrapper, describe_codec

__all__ = [
    "ENTRY_POINT_GROUP", "Codec", "CodecWrapper", "Frame", "LayerSpec", "build_frame",
    "decoder_for", "describe_codec", "discover_codecs", "load_codec_class", "parse_frame",
]
