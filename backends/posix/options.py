"""The ``posix`` tier's options (the gds tier extends them)."""

from __future__ import annotations

from kvplug.config import BaseOptions
from pydantic import ByteSize, ConfigDict, Field


class PosixOptions(BaseOptions):
    """The ``posix`` tier's options (``tiers: [{backend: posix, options: {...}}]``)."""

    model_config = ConfigDict(extra="forbid")
    path: str = Field(description="cache directory (created if missing)")
    capacity: ByteSize = Field(default=ByteSize(20 << 30), description="bytes on disk")
    fsync: bool = Field(default=False, description="fsync each file (and its directory)")
    io_threads: int = Field(default=4, ge=1, le=64, description="writer threads")
    o_direct: bool = Field(
        default=False, description="bypass the page cache where the file system allows it"
    )
    max_pending_writes: int = Field(
        default=256, ge=1, description="queued writes beyond this are dropped (counted)"
    )
    rescan_interval_s: float = Field(
        default=10.0, ge=0, description="re-read the directory at most this often when "
        "evicting (to see other processes' files)",
    )
    max_pinned_fds: int = Field(
        default=1024, ge=0, description="pinned files held open (at most 1/4 of the fd "
        "limit); pins past it protect against this process's eviction only",
    )
