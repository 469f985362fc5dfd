"""Deleting evicted chunk files off the caller's thread, in batches (and, on the same thread, the
mtime bumps that reads which must not wait leave for later: :meth:`Reaper.later`).

Evicting is index work plus one ``unlink`` per file, and the ``unlink`` is what grew with the
tier's size (64 deletes: 6 ms at 10k files, 122 ms at 1M on ext4, a million inodes competing for
the dentry and inode caches; benchmarks/RESULTS.md, "Cost as the cache grows"). The index drops a
victim at once (its bytes are free for accounting); the file is queued here and deleted on one
background thread, a batch at a time in path order (files of one directory together). Until its
file is gone a victim is *doomed*: lookups and reads treat it as a miss (never a stat), a put of
the same chunk is skipped (so a delete never removes a newer file), and a rescan does not index it
again. A crash with deletes queued leaves those files on disk: the next start indexes them and
the capacity bound evicts them again. The thread is a one-thread daemon executor of the tier's
runtime (:mod:`kvplug.runtime`): a queued batch is one task, so a simulation orders deletes
against everything else.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvplug.runtime import THREADS, Runtime

from .index import Entry, unlink_entries


class Reaper:
    """One thread deleting queued victims under ``root`` (ends with a separator)."""

    def __init__(self, root: str, on_error: Callable[[str, OSError], None], name: str,
                 runtime: Runtime = THREADS) -> None:
        self._root = root
        self._on_error = on_error
        self._rt = runtime
        self._cond = runtime.condition(threading.Lock())
        self._queue: list[tuple[str, Entry]] = []
        self._doomed: set[str] = set()  # queued or being deleted
        self._running = False  # a delete task is queued or running
        self._stop = False
        self.deleted = 0  # files deleted (a file already gone is not counted)
        #: Batches that freed less than their victims' bytes: a file already gone (another process
        #: sharing the directory evicted it too) or not deletable (see :meth:`.Directory.make_room`).
        self.short_batches = 0
        self._thread = runtime.executor(1, f"kvplug-{name}-reaper", daemon=True)

    def delete(self, victims: list[tuple[str, Entry]]) -> int:
        """Queue the victims' files for deletion; their bytes (free for accounting now)."""
        if not victims:
            return 0
        with self._cond:
            self._queue += victims
            self._doomed.update(rel for rel, _ in victims)
            start = not self._running and not self._stop  # closed: left for the next start
            self._running = self._running or start
        if start:
            self._thread.submit(self._run)
        return sum(e.size for _, e in victims)

    def later(self, task: Callable[[], None]) -> None:
        """Run a short file-system task on this thread, after the deletes queued before it (a
        read that must not wait hands it the mtime bump of the shared LRU); dropped once the
        reaper is closed."""
        with self._cond:
            if self._stop:
                return
        try:
            self._thread.submit(task)
        except RuntimeError:  # shut down meanwhile
            pass

    def __contains__(self, rel: str) -> bool:
        if not self._doomed:
            # nothing queued (the usual case), read without the lock: what a look under it
            # would have seen at that instant; the caller acts after it is released either way
            return False
        with self._cond:
            return rel in self._doomed

    def doomed(self) -> set[str]:
        with self._cond:
            return set(self._doomed)

    def __len__(self) -> int:
        with self._cond:
            return len(self._doomed)

    def wait_gone(self, rels: list[str], timeout: float | None = None) -> bool:
        """Wait until the files of ``rels`` are deleted (or were never queued); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._doomed.isdisjoint(rels), timeout)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued file is deleted; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._doomed, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Delete what is queued, then stop the thread; False if it is still deleting after
        ``timeout`` seconds (a hung file system: the daemon thread is left to finish)."""
        with self._cond:
            self._stop = True
        done = self.drain(timeout)
        self._thread.shutdown(wait=False)
        return done

    def _run(self) -> None:
        """Delete what is queued, a batch at a time, until nothing is."""
        while True:
            with self._cond:
                if not self._queue:
                    self._running = False
                    return
                batch, self._queue = sorted(self._queue), []
            freed = 0
            try:
                freed, failed = unlink_entries(self._root, batch)
                for path, exc in failed:
                    self._on_error(path, exc)
            finally:
                with self._cond:
                    self.short_batches += freed < sum(e.size for _, e in batch)
                    self.deleted += len(batch)
                    self._doomed.difference_update(rel for rel, _ in batch)
                    self._cond.notify_all()
