"""The posix tier's index: which chunk files exist, their sizes, LRU order and this process's pins.

The directory is the source of truth; the index is a cache of it. It is rebuilt by :func:`scan`
at startup and merged with a fresh scan from time to time (other processes sharing the directory
add and evict files). The LRU stamp of a file is its mtime, which every reader bumps with
``os.utime`` — so processes sharing a directory share one LRU order. Not thread-safe by itself:
its owner (:class:`.directory.Directory`) guards it with the tier's lock.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvplug import chunkfile as cf
from kvplug.pins import PinCounts
from kvplug.policies.tenants import tenant_of_name

from . import fs


class RescanClock:
    """When a rescan of a (shared) directory is due: after ``interval_s``, and never sooner than
    20x the CPU time the last scan took (so scanning a huge directory takes at most ~5% of a core;
    CPU time, not wall time: on a busy machine a scan waits for a core, which costs it nothing).
    ``interval_s`` 0 means before every write, whatever a scan costs (:attr:`every_write`)."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock  # the tier's runtime's (kvplug.runtime)
        self.last = 0.0  # clock() when the last scan ended
        self.cost = 0.0  # the CPU seconds it took

    @property
    def every_write(self) -> bool:
        """Each write looks at the directory first: the only way several processes writing one
        directory hold its capacity (each view lacks the others' newest files)."""
        return self.interval_s == 0

    def due(self) -> bool:
        if self.every_write:
            return True
        return self.clock() - self.last >= max(self.interval_s, 20 * self.cost)

    def scanned(self, cpu_start: float) -> None:
        """A scan that began at ``time.thread_time() == cpu_start`` (on this thread) ended."""
        self.last = self.clock()
        self.cost = time.thread_time() - cpu_start


@dataclass(slots=True)
class Entry:
    size: int
    stamp: float  # last access (wall clock, comparable with file mtimes)


# -- compact form -------------------------------------------------------------------------------
# A tier may index a million files or more, so an entry is two Python ints in a plain dict
# (~150 B, not ~400 B for a path string, an Entry and an OrderedDict node): the key packs the
# hash digits of a canonical name ``<2 hex>/<namespace>.<hex>.safetensors`` with a process-wide
# namespace number; any other name is kept as its string. The value packs the stamp (ms) and size.
_SUFFIX = cf.FILE_SUFFIX
_NS_BITS, _LEN_BITS = 7, 7
_TAG_BITS = _NS_BITS + _LEN_BITS
_namespaces: list[str] = []
_ns_ids: dict[str, int] = {}
_ns_lock = threading.Lock()
_SIZE_BITS = 44
_SIZE_MASK = (1 << _SIZE_BITS) - 1


def _ns_id(ns: str, register: bool) -> int | None:
    nid = _ns_ids.get(ns)
    if nid is None and register:
        with _ns_lock:
            nid = _ns_ids.get(ns)
            if nid is None and len(_namespaces) < (1 << _NS_BITS):
                nid = len(_namespaces)
                _namespaces.append(ns)
                _ns_ids[ns] = nid
    return nid


#: recent names' int keys (a name's key never changes once its namespace is registered: every
#: read, write and lookup of a hot chunk packs its name again); emptied when full
_packed: dict[str, int] = {}
_PACKED_MAX = 4096


def pack_rel(rel: str, register: bool = True) -> int | str:
    """The index key of ``rel``: an int for a canonical chunk name, else ``rel`` itself. The same
    ``rel`` always gives the same key (a namespace not yet registered is not indexed yet)."""
    key = _packed.get(rel)
    if key is None:
        key = _pack_name(rel, register)
        if not isinstance(key, str):
            if len(_packed) >= _PACKED_MAX:
                _packed.clear()
            _packed[rel] = key
    return key


def _pack_name(rel: str, register: bool) -> int | str:
    """:func:`pack_rel` worked out."""
    if rel[2:3] != "/" or not rel.endswith(_SUFFIX):
        return rel
    ns, _, digits = rel[3:-len(_SUFFIX)].rpartition(".")
    half = len(digits) >> 1
    if not ns or half == 0 or half >= (1 << _LEN_BITS) or len(digits) & 1 or rel[:2] != digits[:2]:
        return rel
    nid = _ns_id(ns, register)
    if nid is None:
        return rel
    try:
        raw = bytes.fromhex(digits)
    except ValueError:
        return rel
    if raw.hex() != digits:  # upper case or spaces: not the name a key makes
        return rel
    value = int.from_bytes(raw, "big")
    return (value << _TAG_BITS) | (nid << _LEN_BITS) | half


def unpack_rel(key: int | str) -> str:
    """The relative path a key stands for (inverse of :func:`pack_rel`)."""
    if isinstance(key, str):
        return key
    digits = format(key >> _TAG_BITS, f"0{(key & ((1 << _LEN_BITS) - 1)) * 2}x")
    ns = _namespaces[(key >> _LEN_BITS) & ((1 << _NS_BITS) - 1)]
    return f"{digits[:2]}/{ns}.{digits}{_SUFFIX}"


def _pack(size: int, stamp: float) -> int:
    return (max(0, round(stamp * 1000)) << _SIZE_BITS) | min(size, _SIZE_MASK)


def _size(value: int) -> int:
    return value & _SIZE_MASK


def _stamp(value: int) -> float:
    return (value >> _SIZE_BITS) / 1000


@dataclass
class ScanResult:
    entries: dict[int | str, int]  # packed key -> packed (size, stamp)
    started: float

    def __len__(self) -> int:
        return len(self.entries)


def _is_shard(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


def scan(root: Path, clock: Callable[[], float] = time.time,
         tmp_max_age_s: float = cf.TEMP_MAX_AGE_S) -> ScanResult:
    """Every chunk file under ``root`` (``"shard/name"`` -> size, mtime). Temporary files older
    than ``tmp_max_age_s`` at ``clock()`` (the wall clock of the tier's runtime; left by a
    writer that crashed, in any process) are deleted.

    Only real directories and regular files count: a symlinked shard directory is never entered
    and a link, FIFO or device at a chunk name never indexed (:mod:`.fs`), so no eviction can
    reach outside ``root``. Each shard is read through its own descriptor, so what is listed and
    deleted is what that descriptor holds even if the name is swapped meanwhile."""
    started = clock()
    entries: dict[int | str, int] = {}
    try:
        with os.scandir(root) as it:
            shards = [d.name for d in it if _is_shard(d.name) and d.is_dir(follow_symlinks=False)]
    except OSError:  # missing, not a directory, unreadable: nothing to index
        return ScanResult(entries, started)
    for shard in shards:
        try:
            dfd = fs.open_dir(os.path.join(root, shard))
        except OSError:  # gone, or swapped for a link since it was listed
            continue
        try:
            with os.scandir(dfd) as it:
                files = list(it)
            for f in files:
                try:
                    if cf.is_chunk_file(f.name):
                        if f.is_file(follow_symlinks=False):
                            st = f.stat(follow_symlinks=False)
                            entries[pack_rel(f"{shard}/{f.name}")] = _pack(st.st_size, st.st_mtime)
                    elif cf.is_temp(f.name) and cf.is_stale_temp(
                            f.name, f.stat(follow_symlinks=False).st_mtime, started, tmp_max_age_s):
                        os.unlink(f.name, dir_fd=dfd)
                except OSError:  # removed by another process meanwhile, or not ours to delete
                    continue
        except OSError:
            continue
        finally:
            os.close(dfd)
    return ScanResult(entries, started)


class PosixIndex:
    """LRU of chunk files (least recent first: a dict's insertion order, refreshed by re-inserting)
    with byte accounting; ``pins`` holds this process's pins (a pinned entry is never a victim).

    With an eviction ``policy`` (:mod:`kvplug.policyspecs`; the tier's ``eviction`` setting other
    than ``lru``) the policy picks the victims instead: it hears of every entry added, used and
    removed here, by its packed key, and of what a merge with a fresh scan adds and drops (other
    processes' files). The order of ``_lru`` (the LRU shared through mtimes) is still kept."""

    def __init__(self, policy: Any = None) -> None:
        self._lru: dict[int | str, int] = {}
        self.policy = policy
        #: bytes per tenant id (from each file's name: every process counts the same), and the
        #: bytes reserved per tenant by writes in flight; None until :meth:`track_tenants`
        self.tenants: dict[str, int] | None = None
        self.tenant_reserved: dict[str, int] = {}
        self.pins: PinCounts[str] = PinCounts()
        self.bytes = 0
        self.reserved = 0  # bytes of writes in progress (not indexed until they finish)
        #: files of another format version (rolling upgrades): path -> inode; misses, kept on disk
        self.foreign: OrderedDict[str, int] = OrderedDict()
        #: keys changed while a merge is being prepared, last change last (None: no merge)
        self._changed: dict[int | str, None] | None = None

    def mark_foreign(self, rel: str, ino: int, limit: int = 4096) -> None:
        """Remember that ``rel`` (inode ``ino``) is another version's file: lookups miss it."""
        self.foreign[rel] = ino
        self.foreign.move_to_end(rel)
        if len(self.foreign) > limit:
            self.foreign.popitem(last=False)

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, rel: str) -> bool:
        return pack_rel(rel, register=False) in self._lru

    def rels(self) -> list[str]:
        """Every indexed file's relative path."""
        return [unpack_rel(k) for k in self._lru]

    def size(self, rel: str) -> int | None:
        """The bytes of ``rel``'s file, or None when it is not indexed."""
        value = self._lru.get(pack_rel(rel, register=False))
        return None if value is None else _size(value)

    def track_tenants(self) -> None:
        """Count bytes per tenant from now on (a tier with quotas)."""
        self.tenants = {}
        for k, value in self._lru.items():
            self._tenant_add(unpack_rel(k), _size(value))

    def _tenant_add(self, rel: str, n: int) -> None:
        if self.tenants is not None and n:
            t = tenant_of_name(rel)
            left = self.tenants.get(t, 0) + n
            if left > 0:
                self.tenants[t] = left
            else:
                self.tenants.pop(t, None)

    def _put(self, k: int | str, value: int, rel: str | None = None) -> None:
        old = self._lru.pop(k, None)
        if self.tenants is not None:
            self._tenant_add(rel or unpack_rel(k), _size(value) - (_size(old) if old else 0))
        if self.policy is not None:
            if old is None:
                self.policy.insert(key=k, nbytes=_size(value))
            else:
                self.policy.access(key=k)
        if old is not None:
            self.bytes -= _size(old)
        self._lru[k] = value
        self.bytes += _size(value)
        if self._changed is not None:
            self._changed.pop(k, None)
            self._changed[k] = None

    def add(self, rel: str, size: int, stamp: float) -> None:
        """Insert or refresh an entry as the most recently used."""
        self._put(pack_rel(rel), _pack(size, stamp), rel)

    def touch(self, rel: str, stamp: float, size: int | None = None, every: float = 0.0) -> bool:
        """Make ``rel`` the most recently used entry at ``stamp``; one not indexed is added if
        its ``size`` is given. True when the file's own stamp (its mtime, the LRU shared with
        other processes) is due a bump too: the entry was added, or its stamp is ``every``
        seconds old or more."""
        k = pack_rel(rel)
        value = self._lru.get(k)
        if value is None:
            if size is not None:
                self._put(k, _pack(size, stamp), rel)
            return size is not None
        due = stamp - _stamp(value) >= every
        self._put(k, _pack(_size(value), stamp), rel)
        return due

    def remove(self, rel: str) -> Entry | None:
        k = pack_rel(rel, register=False)
        value = self._lru.pop(k, None)
        if value is None:
            return None
        if self.policy is not None:
            self.policy.remove(key=k)
        self._tenant_add(rel, -_size(value))
        self.bytes -= _size(value)
        if self._changed is not None:
            self._changed.pop(k, None)
            self._changed[k] = None
        return Entry(_size(value), _stamp(value))

    # -- eviction -------------------------------------------------------------------------------
    def take_victims(self, nbytes: int, tenant: str | None = None) -> list[tuple[str, Entry]]:
        """Remove and return least recently used unpinned entries totalling ``>= nbytes`` (or all
        unpinned ones if that is not enough); only ``tenant``'s entries when given."""
        out: list[tuple[str, Entry]] = []
        freed = 0
        pins = self.pins
        if self.policy is not None:
            def evictable(k: Any) -> bool:
                if k not in self._lru:
                    return False
                rel = unpack_rel(k)
                return not (len(pins) and rel in pins) and (
                    tenant is None or tenant_of_name(rel) == tenant)

            for k in self.policy.victims(nbytes=nbytes, evictable=evictable):
                value = self._lru.get(k)
                if value is None:
                    continue
                if not evictable(k):  # a policy that names a kept entry is not obeyed
                    self.policy.insert(key=k, nbytes=_size(value))
                    continue
                out.append((unpack_rel(k), Entry(_size(value), _stamp(value))))
            for rel, _ in out:
                self.remove(rel)
            return out
        for k, value in self._lru.items():
            if freed >= nbytes:
                break
            rel = unpack_rel(k)
            if len(pins) and rel in pins:
                continue
            if tenant is not None and tenant_of_name(rel) != tenant:
                continue
            out.append((rel, Entry(_size(value), _stamp(value))))
            freed += _size(value)
        for rel, _ in out:
            self.remove(rel)
        return out

    def reserve(self, size: int, capacity: int, tenant: str = "",
                limit: int | None = None) -> list[tuple[str, Entry]] | None:
        """Reserve ``size`` bytes of ``tenant`` within ``capacity`` and the tenant's quota
        ``limit``: the victims to delete for it (the tenant's own first, for its quota, then the
        tier's order), or None (nothing taken) when pinned entries leave no room."""
        victims: list[tuple[str, Entry]] = []
        if limit is not None and self.tenants is not None:
            over = (self.tenants.get(tenant, 0) + self.tenant_reserved.get(tenant, 0) + size
                    - limit)
            if size > limit:
                return None
            if over > 0:
                victims = self.take_victims(over, tenant)
                if over - sum(e.size for _, e in victims) > 0:
                    self._restore(victims)
                    return None
        over = self.bytes + self.reserved + size - capacity
        more = self.take_victims(over) if over > 0 else []
        victims += more
        if over - sum(e.size for _, e in more) > 0:
            self._restore(victims)  # not enough: keep what we took
            return None
        self.reserved += size
        if self.tenants is not None:
            self.tenant_reserved[tenant] = self.tenant_reserved.get(tenant, 0) + size
        return victims

    def unreserve(self, size: int, tenant: str = "") -> None:
        """A reserved write is over (written, indexed by :meth:`add`, or failed)."""
        self.reserved -= size
        if self.tenants is not None and size:
            left = self.tenant_reserved.get(tenant, 0) - size
            if left > 0:
                self.tenant_reserved[tenant] = left
            else:
                self.tenant_reserved.pop(tenant, None)

    def _restore(self, victims: list[tuple[str, Entry]]) -> None:
        for rel, entry in victims:
            self.add(rel, entry.size, entry.stamp)

    # -- merging a fresh scan: prepared outside the lock, adopted under it ------------------------
    def begin_merge(self) -> dict[int | str, int]:
        """Under the owner's lock: a copy of the entries to merge a scan into, and start noting
        which keys change until :meth:`finish_merge` (so the slow part runs without the lock)."""
        self._changed = {}
        return dict(self._lru)

    @staticmethod
    def prepare_merge(current: dict[int | str, int], result: ScanResult) -> tuple[dict[int | str, int], int]:
        """Without the lock: files found are kept (newest stamp wins), entries whose files
        vanished before the scan started are dropped; ordered by stamp, oldest first. Returns
        the entries and their bytes."""
        started = _pack(0, result.started)
        merged = result.entries
        for k, value in current.items():
            found = merged.get(k)
            if found is not None:
                if _stamp(value) > _stamp(found):
                    merged[k] = _pack(_size(found), _stamp(value))
            elif value >= started:  # written after the scan listed its shard
                merged[k] = value
        ordered = dict(sorted(merged.items(), key=lambda kv: kv[1] >> _SIZE_BITS))
        return ordered, sum(v & _SIZE_MASK for v in ordered.values())

    def finish_merge(self, prepared: tuple[dict[int | str, int], int]) -> None:
        """Under the owner's lock: adopt what :meth:`prepare_merge` made, replaying what changed
        since :meth:`begin_merge` (changed entries are the most recent ones)."""
        merged, nbytes = prepared
        changed, self._changed = self._changed or {}, None
        for k in changed:
            old = merged.pop(k, None)
            if old is not None:
                nbytes -= _size(old)
            value = self._lru.get(k)
            if value is not None:
                merged[k] = value
                nbytes += _size(value)
        if self.policy is not None:  # other processes' files came and went
            for k in [k for k in self._lru if k not in merged]:
                self.policy.remove(key=k)
            for k, value in merged.items():
                if k not in self._lru:
                    self.policy.insert(key=k, nbytes=_size(value))
        self._lru = merged
        self.bytes = nbytes
        if self.tenants is not None:
            self.track_tenants()

    def abort_merge(self) -> None:
        """Under the owner's lock: a merge begun will not finish (its scan failed)."""
        self._changed = None

    def merge(self, result: ScanResult) -> None:
        """Adopt a fresh scan in one step (the three steps above, for callers without a lock)."""
        self.finish_merge(self.prepare_merge(self.begin_merge(), result))


def stat_entry(path: str) -> Entry | None:
    """An index entry (size, mtime stamp) for a chunk file, or None if it is gone or not a
    regular file in a real shard directory (no link followed: :func:`.fs.lstat_chunk`)."""
    st = fs.lstat_chunk(path)
    return None if st is None else Entry(st.st_size, st.st_mtime)


def unlink_entries(root: str, victims: list[tuple[str, Entry]]) -> tuple[int, list[tuple[str, OSError]]]:
    """Delete the files of evicted entries (``root`` ends with a separator): ``(bytes freed,
    [(path, error)])``. A file already gone (another process evicted it) frees nothing. Deleted
    through the shard's descriptor (:func:`.fs.unlink_chunk`): never anything outside ``root``."""
    freed = 0
    failed: list[tuple[str, OSError]] = []
    for rel, entry in victims:
        try:
            fs.unlink_chunk(root + rel)
            freed += entry.size
        except FileNotFoundError:
            pass
        except OSError as exc:
            failed.append((root + rel, exc))
    return freed, failed
