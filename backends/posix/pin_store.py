"""An operator's pins on the posix tier (``kvplug cache pin``), kept across restarts.

A pinned chunk file is pinned as a lookup pins it (``PosixBackend._pin``: never evicted by this
process, held open against others) and listed in ``<root>/kvplug-pins.json`` (the tier's file
mode, 0600 by default; written atomically, under an ``flock`` of the root so processes sharing
the directory merge their changes, each adding and removing only its own). The lock is waited for
at most :data:`LOCK_WAIT_S` (whoever can open the root — a group member of a group-shared
directory — can hold a lock on it for good): past it, the pins hold in this process but the file
is not updated; counted (``pins_not_saved``), logged, and reported by the management call. At
start-up the listed files are pinned again before the scan trims the directory to its capacity,
so a restart never evicts them.

The file is untrusted (whoever can write the directory wrote it): it never chooses a path or a
size, and what it lists never crowds out the operator's own pins. It is opened without following
a link or blocking, bounded in size, and read only in the exact form kvplug writes (no JSON
parser: nothing nested, nothing recursive); every entry must be a chunk name in a shard directory
(``<2 hex>/<[A-Za-z0-9._-]>.safetensors``) and, at start-up, every listed file that exists must be
a chunk of this tier (its header checked, with the deployment's keyring where there is one).
With ``auth_key_env`` the list is sealed with the deployment's key (``"mac"``): a file without
the seal, or whose seal does not match its list, was not written by the deployment. A file that
breaks any of this is ignored whole, with the reason logged; a pin whose file is gone is dropped
from it. Pins past the tier's ``max_pinned_fraction`` at start-up (the setting was lowered, or
another process sharing the directory pinned them) are not restored here, the first listed kept,
and logged.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hmac
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvplug import chunkfile as cf
from kvplug.chunkfile.atomic import atomic_file

from . import fs

if TYPE_CHECKING:
    from .directory import Directory
    from .held import HeldFiles

logger = logging.getLogger("kvplug.backends.posix")

PIN_FILE = "kvplug-pins.json"
#: the largest pins file read (about 50,000 pins)
MAX_PIN_FILE = 8 << 20
#: The longest wait for the root's lock (processes sharing the directory hold it for one update).
LOCK_WAIT_S = 2.0
_LOCK_RETRY_S = 0.02
_REL = re.compile(r"[0-9a-f]{2}/[A-Za-z0-9_-][A-Za-z0-9._-]{0,250}\.safetensors")
#: The file as :meth:`PinFile.update` writes it: the seal (with a keyring), then the list.
_FORM = re.compile(r'\{"version": 1, (?:"mac": "(?P<mac>[0-9a-f]{64})", )?"pins": \[(?P<list>.*)\]\}',
                   re.DOTALL)


class NotPins(ValueError):
    """Why a pins file is ignored whole."""


def _seal(auth: cf.Keyring, pins: list[str]) -> str:
    """The deployment's seal of a list of pins (a keyed BLAKE2b of it, the names key)."""
    return auth.name_digest("kvplug-pins\0" + json.dumps(pins))


def encode_pins(pins: list[str], auth: cf.Keyring | None) -> str:
    """The pins file listing ``pins`` (sealed with ``auth``'s key where given)."""
    body: dict[str, object] = {"version": 1}
    if auth is not None:
        body["mac"] = _seal(auth, pins)
    body["pins"] = pins
    return json.dumps(body)


def decode_pins(text: str, auth: cf.Keyring | None) -> list[str]:
    """The pins a file lists, checked (module docstring); :class:`NotPins` saying why not. No
    JSON parser runs: the form is matched and the list split, so nothing nested is built."""
    form = _FORM.fullmatch(text.strip())
    if form is None:
        raise NotPins('it is not {"version": 1, "pins": [...]} as kvplug writes it')
    inner = form["list"]
    pins = inner[1:-1].split('", "') if inner else []
    if inner and (not inner.startswith('"') or not inner.endswith('"')):
        raise NotPins("its list is not a list of names")
    for rel in pins:
        if not _REL.fullmatch(rel):
            raise NotPins(f"it lists {rel[:80]!r}, which is not a chunk file's name in a shard "
                          "directory")
    if auth is not None and (form["mac"] is None
                             or not hmac.compare_digest(_seal(auth, pins), form["mac"])):
        raise NotPins("it is not sealed with this deployment's key (auth_key_env)")
    return list(dict.fromkeys(pins))


class PinFile:
    """``<root>/kvplug-pins.json``: the relative paths an operator pinned."""

    def __init__(self, root: Path, mode: int, gid: int | None, tier: str,
                 auth: cf.Keyring | None = None) -> None:
        self.path = root / PIN_FILE
        self.root = root
        self.mode = mode
        self.gid = gid
        self.tier = tier
        self.auth = auth

    def load(self) -> list[str]:
        """The pinned paths listed, in order; ``[]`` (the reason logged) for a missing, unsafe,
        malformed or unsealed file."""
        try:
            return decode_pins(self._read(), self.auth)
        except FileNotFoundError:
            return []
        except NotPins as exc:
            return self.ignored(str(exc))
        except OSError as exc:
            return self.ignored(f"cannot read it ({exc.strerror or exc}; a link is never "
                                "followed, nor anything but a regular file opened)")

    def _read(self) -> str:
        """The file's text: never through a link, never blocking, at most :data:`MAX_PIN_FILE`."""
        fd = fs.require_regular(os.open(self.path, fs.READ_FLAGS), str(self.path))
        try:
            raw = os.read(fd, MAX_PIN_FILE + 1)
        finally:
            os.close(fd)
        if len(raw) > MAX_PIN_FILE:
            raise NotPins(f"it is larger than {MAX_PIN_FILE} bytes")
        try:
            return raw.decode("ascii")
        except UnicodeDecodeError:
            raise NotPins("it is not ASCII text") from None

    def ignored(self, why: str) -> list[str]:
        logger.warning("tier %r: the pins file %s is ignored: %s; no pin is restored from it "
                       "(pin again with `kvplug cache pin`)", self.tier, self.path, why)
        return []

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """An exclusive ``flock`` of the root (processes sharing it update the file in turn),
        waited for at most :data:`LOCK_WAIT_S`: ``TimeoutError`` past it, never a thread held
        for good by whoever holds a lock on the root."""
        dfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            deadline = time.monotonic() + LOCK_WAIT_S
            while True:
                try:
                    fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise TimeoutError(errno.EWOULDBLOCK, f"another process held a lock on "
                                           f"{self.root} for {LOCK_WAIT_S:g} s") from None
                    time.sleep(_LOCK_RETRY_S)
            yield
        finally:
            os.close(dfd)  # releases the lock

    def update(self, added: Iterable[str], removed: Iterable[str]) -> None:
        """Add and remove paths (what this process pinned and unpinned), keeping the others'."""
        added, removed = list(added), set(removed)
        if not added and not removed:
            return
        with self._locked():
            current = [r for r in self.load() if r not in removed]
            pins = list(dict.fromkeys(current + added))
            with atomic_file(self.path, file_mode=self.mode, gid=self.gid, no_follow=True) as tmp:
                tmp.write_text(encode_pins(pins, self.auth))


class OperatorPins:
    """An operator's pins of one posix tier (``operator_pin``/``operator_unpin``), bounded by
    ``max_fraction`` of the capacity, listed in ``pin_file`` (None: a read-only directory, pins
    held until the process ends) and restored around the start-up scan (:meth:`around_scan`).
    ``pin(rel)`` pins a file as a lookup does (the tier's own rule); False when it is gone.
    ``check(rel)`` says why ``rel``'s file is not a chunk of this tier (``None``: it is, or it is
    gone): a pins file listing one is ignored whole."""

    def __init__(self, directory: Directory, held: HeldFiles, pin_file: PinFile | None,
                 max_fraction: float, pin: Callable[[str], bool],
                 check: Callable[[str], str | None] = lambda rel: None) -> None:
        self._dir = directory
        self._held = held
        self._file = pin_file
        self._max_pinned = max_fraction
        self._pin = pin
        self._check = check
        self._pins: dict[str, int] = {}  # rel -> bytes (from the index), under the tier's lock
        self._not_saved = 0  # updates of the pins file that failed (its lock not had, a write)

    def _save(self, added: Sequence[str], removed: Sequence[str]) -> None:
        if self._file is None:
            return
        try:
            self._file.update(added, removed)
        except OSError as exc:
            with self._dir.lock:
                self._not_saved += 1
            logger.warning("tier %r: cannot update the pins file %s (%s): the pins hold until "
                           "this process ends, not across a restart (counted in stats as "
                           "pins_not_saved)", self._dir.name, self._file.path, exc)

    def _listed(self) -> list[str]:
        """The pins file's list, each listed file that exists a chunk of this tier; ``[]`` (the
        reason logged) otherwise. Never raises: the start-up scan goes on whatever it holds."""
        if self._file is None:
            return []
        try:
            rels = self._file.load()
            for rel in rels:
                why = self._check(rel)
                if why is not None:
                    return self._file.ignored(f"it lists {rel}, which is not a chunk of this "
                                              f"tier ({why})")
            return rels
        except Exception as exc:  # noqa: BLE001 - whatever it holds, the scan goes on
            return self._file.ignored(f"reading it failed ({type(exc).__name__})")

    def around_scan(self, trim: Callable[[], None]) -> None:
        """The start-up scan's ``trim`` with the listed pins restored around it: pinned (in the
        index only) before, so the trim keeps them; then kept where the scan found their files,
        within ``max_pinned_fraction``, held open. The rest are released; files gone are
        dropped from the pins file."""
        rels = self._listed()
        with self._dir.lock:
            self._dir.index.pins.pin_all(rels)
        trim()
        kept, gone, over = [], [], 0
        limit = self._max_pinned * self._dir.capacity
        with self._dir.lock:
            held = 0
            for rel in rels:
                size = self._dir.index.size(rel)
                if size is not None and held + size <= limit:
                    held += size
                    self._pins[rel] = size
                    kept.append(rel)
                else:
                    over += size is not None
                    if size is None:
                        gone.append(rel)
                    self._dir.index.pins.unpin(rel)
        for rel in kept:
            if not self._held.hold(rel, self._dir.path(rel)):
                with self._dir.lock:
                    self._pins.pop(rel, None)
                    self._dir.index.pins.unpin(rel)
                gone.append(rel)
        if over:  # left in the file (another process sharing the directory may hold them)
            logger.warning("tier %r: %d pins of the pins file are past max_pinned_fraction %g of "
                           "the capacity; not restored here", self._dir.name, over,
                           self._max_pinned)
        if rels:
            logger.info("tier %r: %d operator pins restored, %d files gone", self._dir.name,
                        len(rels) - len(gone) - over, len(gone))
        self._save([], gone)  # the files that are gone: no process can pin them again

    def pin(self, rels: Sequence[str]) -> list[str]:
        """Pin each file: ``"pinned"``, ``"absent"`` or ``"over_limit"`` (the hook's answers)."""
        out, added = [], []
        index, lock = self._dir.index, self._dir.lock
        limit = self._max_pinned * self._dir.capacity
        for rel in rels:
            with lock:
                size = index.size(rel)
            if size is None:
                size = self._dir.adopt(rel)  # another process's file (or not indexed yet)
            with lock:
                known = rel in self._pins
                room = size is not None and sum(self._pins.values()) + size <= limit
            if known:
                out.append("pinned")
            elif size is None:
                out.append("absent")
            elif not room:
                out.append("over_limit")
            elif self._pin(rel):
                with lock:
                    self._pins[rel] = size
                added.append(rel)
                out.append("pinned")
            else:
                out.append("absent")
        self._save(added, [])
        return out

    def unpin(self, rels: Sequence[str]) -> list[bool]:
        """Release each file's operator pin; True where one was held."""
        out, removed = [], []
        for rel in rels:
            with self._dir.lock:
                held = self._pins.pop(rel, None) is not None
                if held:
                    self._dir.index.pins.unpin(rel)
            if held:
                self._held.release(rel)
                removed.append(rel)
            out.append(held)
        self._save([], removed)
        return out

    def stats(self) -> dict[str, float]:
        with self._dir.lock:
            return {"operator_pinned": len(self._pins),
                    "operator_pinned_bytes": sum(self._pins.values()),
                    "pins_not_saved": self._not_saved}
