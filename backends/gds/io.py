"""kvikio I/O of the gds tier: chunk files (:mod:`kvplug.chunkfile`) through ``kvikio.CuFile``.

Buffers go to kvikio as they are: a CUDA tensor (``__cuda_array_interface__``: with GDS the
bytes move by DMA between the file and device memory) or a host tensor's numpy view (kvikio's
POSIX path, no intermediate copy). The 4 KiB header is host metadata, read by the posix tier's
header reader; writes are atomic through :func:`kvplug.chunkfile.atomic_file`.

The format's per-layer checksum is xxh3_64, which has no GPU implementation here: for a *device*
buffer each layer is copied once into a small reusable pinned host scratch only to be hashed (on
store before the header is written, on load after the DMA). That copy is for verification; the
payload itself never goes through host memory on its way between file and GPU.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from kvplug import chunkfile as cf
from kvplug.chunkfile.atomic import FILE_MODE
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj

from ..posix.held import fd_path
from ..posix.io import ChunkFileIO, CorruptChunk, read_checked_header

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


def layer_sums(flat: torch.Tensor, num_layers: int, mac: cf.ChunkMac | None = None,
               first: int = 0) -> list[str]:
    """The format's per-layer checksums (with ``mac``: tags, layer indices from ``first``) of a
    flat uint8 tensor (all layers back to back): a host tensor through
    :func:`kvplug.chunkfile.split_layers`, a device tensor layer by layer from a pinned host
    copy (the only host copy on the device path)."""
    def one(i: int, view) -> str:  # noqa: ANN001 - a buffer
        return cf.checksum(view) if mac is None else mac.layer_tag(first + i, view)

    if not flat.is_cuda:
        return [one(i, v) for i, v in enumerate(cf.split_layers(flat.numpy(), num_layers))]
    out: list[str] = []
    for i, layer in enumerate(flat.view(num_layers, flat.numel() // num_layers)
                              if num_layers else ()):
        host = _scratch(layer.numel())
        host.copy_(layer)  # synchronous D2H
        out.append(one(i, memoryview(host.numpy())))
    return out


class ShortIO(OSError):
    """kvikio moved fewer bytes than asked (end of file on a read)."""


def _layer_jobs(op: Callable[..., Any], flat: torch.Tensor, header: cf.ChunkHeader, first: int,
                count: int) -> list[tuple[Any, int]]:
    """Start kvikio ``op`` (``CuFile.pread``/``pwrite``) for layers ``[first, first + count)``
    held back to back in ``flat``: one call when layers are unpadded, else one per layer.
    Returns ``(future, bytes)`` pairs for :func:`_wait`."""
    n = header.layer_nbytes
    if not n or not count:
        return []
    if header.layer_stride == n:
        return [(op(as_buffer(flat), file_offset=header.data_offsets[first]), flat.numel())]
    return [(op(as_buffer(flat[i * n : (i + 1) * n]), file_offset=header.data_offsets[first + i]), n)
            for i in range(count)]


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


def write_chunk(path: str | Path, key: CacheKey, obj: MemoryObj, *, fsync: bool = False,
                auth: cf.Keyring | None = None, file_mode: int = FILE_MODE,
                gid: int | None = None) -> int:
    """Write ``obj`` (host or device) as ``key``'s chunk file at ``path`` atomically (temporary
    name + rename, as the posix tier does, ``file_mode`` and group ``gid``, never through a
    symlinked shard); returns the file size. Raises ``OSError``."""
    flat = obj.byte_view
    key = cf.stored_key(key, auth)  # what the header records (a veiled hash with auth)
    mac = auth.seal(key) if auth is not None else None
    sums = layer_sums(flat, cf.chunk_layout(obj.meta)[0], mac)
    header = cf.encode_header(key, obj.meta, sums, mac)
    head = cf.make_header(key, obj.meta, sums, len(header), mac)
    header_buf = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    with cf.atomic_file(path, fsync=fsync, file_mode=file_mode, gid=gid, no_follow=True) as tmp:
        with _kvikio().CuFile(tmp, "w") as f:
            jobs = [(f.pwrite(as_buffer(header_buf), file_offset=0), len(header))]
            _wait(jobs + _layer_jobs(f.pwrite, flat, head, 0, head.num_layers), "write")
        os.truncate(tmp, head.file_size)  # the last layer's padding (zeros) makes the file whole
    return head.file_size


def _read_header(fd: int, key: CacheKey, auth: cf.Keyring | None = None,
                 max_header: int | None = None) -> tuple[cf.ChunkHeader, int]:
    """The checked header of ``key``'s open file and its inode. :class:`CorruptChunk` if it is
    damaged, longer than ``max_header`` or holds another key."""
    st = os.fstat(fd)
    return read_checked_header(fd, st, key, auth=auth, max_header=max_header)[0], st.st_ino


def _read_layers(fd: int, header: cf.ChunkHeader, ino: int, dest: torch.Tensor,
                 first: int, count: int, *, verify: bool = True) -> None:
    """Read layers ``[first, first + count)`` into ``dest`` (host or device, their bytes back to
    back), then verify their checksums. Raises :class:`CorruptChunk` on a short read or a
    checksum mismatch."""
    flat = dest.reshape(-1).view(torch.uint8)
    if flat.numel() != header.layer_nbytes * count:
        raise ValueError(f"destination holds {flat.numel()} bytes, layers need "
                         f"{header.layer_nbytes * count}")
    with _kvikio().CuFile(fd_path(fd), "r") as f:  # the file ``fd`` is, never a path's link
        try:
            _wait(_layer_jobs(f.pread, flat, header, first, count), "read")
        except ShortIO:
            raise CorruptChunk("file ended early (truncated while reading)", ino) from None
    if header.mac is not None:  # authenticated: always verified, tag by tag
        sums = layer_sums(flat, count, header.mac, first)
        if not all(header.mac.check(want, got, f"layer {first + i}") for i, (want, got) in
                   enumerate(zip(header.checksums[first : first + count], sums, strict=True))):
            raise CorruptChunk("layer MAC mismatch", ino)
    elif verify and layer_sums(flat, count) != header.checksums[first : first + count]:
        raise CorruptChunk("layer checksum mismatch", ino)


def read_chunk(fd: int, key: CacheKey, allocate: Callable[..., MemoryObj | None],
               layers: tuple[int, int] | None = None, *, verify_device: bool = True,
               auth: cf.Keyring | None = None,
               max_header: int | None = None) -> tuple[MemoryObj | None, int]:
    """Same contract as the posix tier's ``read_chunk`` (an open chunk file ``fd``, opened by
    :func:`kvplug.backends.posix.fs.open_chunk`), through kvikio: ``(obj, file_size)`` (with
    ``auth``, every read is verified, ``verify_device`` or not)."""
    header, ino = _read_header(fd, key, auth, max_header)
    first, count, meta = header.select(layers)
    obj = allocate(meta.shape, meta.dtype, meta.fmt, meta.num_tokens)
    if obj is None:
        return None, header.file_size
    try:
        dest = obj.byte_view
        _read_layers(fd, header, ino, dest, first, count, verify=verify_device or not dest.is_cuda)
    except BaseException:
        obj.ref_down()
        raise
    return obj, header.file_size


def chunk_file_size(key: CacheKey, obj: MemoryObj, auth: cf.Keyring | None = None) -> int:
    """Size of the chunk file of ``obj`` (known before its checksums are: they have a fixed
    length, so placeholders give the same header size; with ``auth``, tags and a MAC)."""
    key = cf.stored_key(key, auth)  # the header's key: its length sizes the header
    mac = auth.seal(key) if auth is not None else None
    sums = ["0" * (16 if mac is None else cf.auth.TAG_HEX)] * cf.chunk_layout(obj.meta)[0]
    header = cf.encode_header(key, obj.meta, sums, mac)
    return cf.make_header(key, obj.meta, sums, len(header)).file_size


class KvikioFileIO(ChunkFileIO):
    """The posix tier's :class:`~kvplug.backends.posix.io.ChunkFileIO` with the bytes moved by
    kvikio (:func:`write_chunk`, :func:`read_chunk`: host or device memory); headers are read and
    checked by the posix tier's reader, not kept."""

    def __init__(self, allocate: Callable[..., MemoryObj | None], auth: cf.Keyring | None, *,
                 fsync: bool = False, file_mode: int = FILE_MODE, gid: int | None = None,
                 verify_device: bool = True,
                 header_limit: Callable[[], int | None] = lambda: None) -> None:
        super().__init__(allocate, auth, fsync=fsync, file_mode=file_mode, gid=gid,
                         header_limit=header_limit)
        self.verify_device = verify_device

    def prepare_write(self, key: CacheKey, rel: str,
                      obj: MemoryObj) -> tuple[int, Callable[[str], int]]:
        return chunk_file_size(key, obj, self.auth), lambda path, dir_fd=None: write_chunk(
            path, key, obj, fsync=self.fsync, auth=self.auth, file_mode=self.file_mode,
            gid=self.gid)  # kvikio opens by path: the shard's descriptor is not used

    def read_nowait(self, fd: int, key: CacheKey, rel: str, st: object = None) -> None:
        """kvikio reads cannot be asked not to wait: every read goes through :meth:`read`."""
        return None

    def read(self, fd: int, key: CacheKey, rel: str,
             layers: tuple[int, int] | None) -> tuple[MemoryObj | None, int]:
        return read_chunk(fd, key, self.allocate, layers, verify_device=self.verify_device,
                          auth=self.auth, max_header=self.header_limit())
