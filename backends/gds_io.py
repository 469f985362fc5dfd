"""kvikio I/O of the gds tier: chunk files (:mod:`kvplug.chunk_format`) through ``kvikio.CuFile``.

Buffers go to kvikio as they are: a CUDA tensor (``__cuda_array_interface__``: with GDS the
bytes move by DMA between the file and device memory) or a host tensor's numpy view (kvikio's
POSIX path, no intermediate copy). The 4 KiB header is host metadata and is read with ``os.pread``.

The format's per-layer checksum is xxh3_64, which has no GPU implementation here: for a *device*
buffer each layer is copied once into a small reusable pinned host scratch only to be hashed (on
store before the header is written, on load after the DMA). That copy is for verification; the
payload itself never goes through host memory on its way between file and GPU.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from kvplug import chunk_format as cf
from kvplug.errors import ChunkFormatError
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj

from .posix_io import TMP_SUFFIX, CorruptChunk

_local = threading.local()


def _kvikio() -> Any:
    import kvikio

    return kvikio


def as_buffer(t: torch.Tensor) -> Any:
    """What kvikio accepts: a CUDA tensor itself, a host tensor's numpy view (zero-copy)."""
    flat = t.reshape(-1).view(torch.uint8)
    return flat if flat.is_cuda else flat.numpy()


def _scratch(nbytes: int) -> torch.Tensor:
    """Per-thread pinned host buffer for hashing device layers (grown on demand)."""
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(cf.align_up(max(nbytes, 1)), dtype=torch.uint8,
                          pin_memory=torch.cuda.is_available())
        _local.scratch = buf
    return buf[:nbytes]


def layer_sums(flat: torch.Tensor, num_layers: int) -> list[str]:
    """xxh3 of each layer of a flat uint8 tensor; a device tensor is hashed from a host copy."""
    n = flat.numel() // num_layers if num_layers else 0
    out: list[str] = []
    for i in range(num_layers):
        part = flat[i * n : (i + 1) * n]
        if part.is_cuda:
            host = _scratch(n)
            host.copy_(part)  # synchronous D2H: the only host copy on the device path
            part = host
        out.append(cf.checksum(memoryview(part.numpy())))
    return out


class ShortIO(OSError):
    """kvikio moved fewer bytes than asked (end of file on a read)."""


def _wait(futures: list[tuple[Any, int]], what: str) -> None:
    """Wait for every future (all of them, even after a failure); raise the first problem."""
    problem: OSError | None = None
    for fut, want in futures:
        try:
            got = fut.get()
        except RuntimeError as exc:  # kvikio reports I/O errors as RuntimeError
            problem = problem or OSError(f"kvikio {what} failed: {exc}")
            continue
        if got != want:
            problem = problem or ShortIO(f"kvikio {what} moved {got} of {want} bytes")
    if problem is not None:
        raise problem


def write_chunk(path: str | Path, key: CacheKey, obj: MemoryObj, *, fsync: bool = False) -> int:
    """Write ``obj`` (host or device) as ``key``'s chunk file at ``path`` atomically (temporary
    name + rename, as the posix tier does); returns the file size. Raises ``OSError``."""
    path = Path(path)
    flat = obj.byte_view
    layers = cf.chunk_layout(obj.meta)[0]
    header = cf.encode_header(key, obj.meta, layer_sums(flat, layers))
    stride_pad = cf.align_up(flat.numel() // layers if layers else 0) * layers - flat.numel()
    size = len(header) + flat.numel() + stride_pad
    head = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
    path.parent.mkdir(parents=True, exist_ok=True)
    kvikio = _kvikio()
    with cf.discard_on_failure(tmp):
        with kvikio.CuFile(tmp, "w") as f:
            jobs = [(f.pwrite(as_buffer(head), file_offset=0), len(header))]
            n = flat.numel() // layers if layers else 0
            if stride_pad == 0 and flat.numel():  # layers are back to back: one write
                jobs.append((f.pwrite(as_buffer(flat), file_offset=len(header)), flat.numel()))
            elif n:
                stride = cf.align_up(n)
                for i in range(layers):
                    part = flat[i * n : (i + 1) * n]
                    jobs.append((f.pwrite(as_buffer(part), file_offset=len(header) + i * stride),
                                 n))
            _wait(jobs, "write")
        os.truncate(tmp, size)  # the last layer's padding (zeros) makes the file whole
        if fsync:
            _fsync(tmp)
        os.rename(tmp, path)
    if fsync:
        _fsync(path.parent, directory=True)
    return size


def _fsync(p: Path, directory: bool = False) -> None:
    fd = os.open(p, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_header(path: str | Path, key: CacheKey) -> tuple[cf.ChunkHeader, int]:
    """The checked header of ``key``'s file and its inode. ``FileNotFoundError`` if absent,
    :class:`CorruptChunk` if it is damaged or holds another key."""
    path = Path(path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        try:
            prefix = os.pread(fd, cf.HEADER_PROBE, 0)
            need = cf.header_size(prefix[:8])
            if need > len(prefix):
                prefix += os.pread(fd, need - len(prefix), len(prefix))
            header = cf.decode_header(prefix, st.st_size)
            if header.key != key:
                raise ChunkFormatError(f"file holds key {header.key}, not {key}")
        except ChunkFormatError as exc:
            raise CorruptChunk(str(exc), st.st_ino) from None
        return header, st.st_ino
    finally:
        os.close(fd)


def read_layers_into(path: str | Path, header: cf.ChunkHeader, ino: int, dest: torch.Tensor,
                     first: int, count: int, *, verify: bool = True) -> None:
    """Read layers ``[first, first + count)`` into ``dest`` (host or device, their bytes back to
    back), one ``pread`` per layer (one in all when layers are unpadded), then verify checksums.
    Raises :class:`CorruptChunk` on a short read or a checksum mismatch."""
    path = Path(path)
    flat = dest.reshape(-1).view(torch.uint8)
    n = header.layer_nbytes
    if flat.numel() != n * count:
        raise ValueError(f"destination holds {flat.numel()} bytes, layers need {n * count}")
    if not n or not count:
        return
    with _kvikio().CuFile(path, "r") as f:
        if header.layer_stride == n:
            jobs = [(f.pread(as_buffer(flat), file_offset=header.data_offsets[first]),
                     flat.numel())]
        else:
            jobs = [(f.pread(as_buffer(flat[i * n : (i + 1) * n]),
                             file_offset=header.data_offsets[first + i]), n)
                    for i in range(count)]
        try:
            _wait(jobs, "read")
        except ShortIO:
            raise CorruptChunk("file ended early (truncated while reading)", ino) from None
    if verify and layer_sums(flat, count) != header.checksums[first : first + count]:
        raise CorruptChunk("layer checksum mismatch", ino)


def read_chunk(path: str | Path, key: CacheKey, allocate: Callable[..., MemoryObj | None],
               layers: tuple[int, int] | None = None, *, verify_device: bool = True,
               ) -> tuple[MemoryObj | None, int]:
    """Same contract as ``posix_io.read_chunk``, through kvikio: ``(obj, file_size)``."""
    path = Path(path)
    header, ino = read_header(path, key)
    first, count, meta = header.select(layers)
    obj = allocate(meta.shape, meta.dtype, meta.fmt, meta.num_tokens)
    if obj is None:
        return None, header.file_size
    try:
        dest = obj.byte_view
        read_layers_into(path, header, ino, dest, first, count,
                         verify=verify_device or not dest.is_cuda)
    except BaseException:
        obj.ref_down()
        raise
    return obj, header.file_size
