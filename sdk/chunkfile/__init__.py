"""The chunk-file library: one format, one naming rule, one atomic write, for every file tier.

posix, gds, fsspec and ``kvplug inspect`` all read and write chunks through this package, so a
directory or bucket written by one is read by the others:

* :mod:`.format`    — the safetensors-compatible layout: header encoding and checking, layer ranges;
* :mod:`.checksums` — xxh3_64 (or a MAC) per layer, verification of what was read;
* :mod:`.auth`      — the deployment secret's keyring: chunk MACs and keyed names;
* :mod:`.crypt`     — encryption at rest (``encrypt: true``): AES-256-GCM layers per tenant;
* :mod:`.names`     — chunk paths from keys, temporary names and :func:`is_temp`;
* :mod:`.atomic`    — temporary file + rename + fsync of file and directory;
* :mod:`.reader`    — the header of a file through any ``read(offset, length)``.
"""

from .atomic import atomic_file, discard_on_failure, fsync_path
from .auth import MAC_ALGO, AuthError, ChunkMac, Keyring, decode_secret
from .checksums import CHECKSUM_ALGO, checksum, layer_sums, split_layers, verify_layer, verify_layers
from .crypt import ENC_ALGO, ChunkCipher
from .format import (
    ALIGN,
    CODEC_VERSION_SUFFIX,
    FORMAT_NAME,
    FORMAT_VERSION,
    HEADER_PROBE,
    MAC_VERSION_SUFFIX,
    MAX_HEADER,
    ChunkHeader,
    align_up,
    check_layer_range,
    chunk_layout,
    decode_header,
    encode_chunk,
    encode_chunk_with_header,
    encode_header,
    format_version,
    header_size,
    holds,
    layer_checksums,
    make_header,
    max_header_bytes,
    read_buffers,
    stored_key,
)
from .names import (
    FILE_SUFFIX,
    TEMP_MAX_AGE_S,
    TEMP_SUFFIX,
    chunk_name,
    chunk_path,
    is_chunk_file,
    is_stale_temp,
    is_temp,
    namespace_dir,
    relative_chunk_path,
    shard_of,
    temp_name,
)
from .reader import ReadAt, read_header, read_header_fd

__all__ = [
    "MAC_ALGO", "MAC_VERSION_SUFFIX", "AuthError", "ChunkMac", "Keyring", "decode_secret",
    "ENC_ALGO", "ChunkCipher",
    "layer_sums", "namespace_dir", "ALIGN", "CHECKSUM_ALGO", "CODEC_VERSION_SUFFIX",
    "FILE_SUFFIX", "FORMAT_NAME", "FORMAT_VERSION",
    "HEADER_PROBE", "MAX_HEADER", "TEMP_MAX_AGE_S", "TEMP_SUFFIX", "ChunkHeader", "ReadAt",
    "align_up", "atomic_file", "check_layer_range", "checksum", "chunk_layout", "chunk_name",
    "chunk_path", "decode_header", "discard_on_failure", "encode_chunk", "encode_chunk_with_header",
    "encode_header", "format_version", "fsync_path", "header_size", "holds", "is_chunk_file",
    "is_stale_temp", "is_temp", "layer_checksums", "make_header", "max_header_bytes",
    "read_buffers", "read_header",
    "read_header_fd", "relative_chunk_path", "shard_of", "split_layers", "stored_key", "temp_name",
    "verify_layer", "verify_layers",
]
