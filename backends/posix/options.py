"""The ``posix`` tier's options (the gds tier extends them)."""

from __future__ import annotations

import grp

from kvplug.config import BaseOptions
from pydantic import ByteSize, ConfigDict, Field, field_validator


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
    file_mode: str = Field(
        default="0600", description="octal mode of chunk files (directories get the matching "
        "mode: 0600 -> 0700, 0640 -> 0750); widen it only for a group-shared directory",
    )
    group: str | int | None = Field(
        default=None, description="group (name or gid) of the files and directories kvplug "
        "creates, for a directory shared by the users of one group (with file_mode 0640/0660)",
    )

    @field_validator("file_mode", mode="before")
    @classmethod
    def _octal_mode(cls, v: object) -> str:
        """An octal string of permission bits the owner can read and write, without execute
        or set-id bits (``0600``, ``0640``, ``0660``)."""
        text = str(v).strip()
        try:
            mode = int(text, 8)
        except ValueError:
            raise ValueError(f"file_mode {text!r} is not an octal mode: write it like '0600' "
                             "or '0640'") from None
        if mode & ~0o777:
            raise ValueError(f"file_mode {text!r} has bits beyond the permission bits (0777): "
                             "set-id and sticky bits are not allowed; use e.g. '0640'")
        if mode & 0o600 != 0o600:
            raise ValueError(f"file_mode {text!r} does not let the owner read and write its "
                             "files: it must include 0600 (e.g. '0600' or '0640')")
        if mode & 0o111:
            raise ValueError(f"file_mode {text!r} has execute bits: chunk files are data; use "
                             "e.g. '0640'")
        return f"0{mode:03o}"

    @field_validator("group", mode="before")
    @classmethod
    def _known_group(cls, v: object) -> str | int | None:
        """A group that exists on this machine (by name), or a gid."""
        if v is None or isinstance(v, int):
            if isinstance(v, int) and v < 0:
                raise ValueError(f"group {v} is not a gid: use a group name or a gid >= 0")
            return v
        name = str(v).strip()
        if name.isdigit():
            return int(name)
        try:
            grp.getgrnam(name)
        except KeyError:
            raise ValueError(f"group {name!r} does not exist on this machine: name an existing "
                             "group (see `getent group`) or give a numeric gid") from None
        return name

    @property
    def mode(self) -> int:
        """:attr:`file_mode` as a number."""
        return int(self.file_mode, 8)

    @property
    def gid(self) -> int | None:
        """:attr:`group` as a gid (None: the creating process's group)."""
        if self.group is None or isinstance(self.group, int):
            return self.group
        return grp.getgrnam(self.group).gr_gid
