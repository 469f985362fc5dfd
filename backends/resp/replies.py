"""Reading pipelined replies straight off the socket: ``EXISTS`` (integers), and ``GET`` into
caller memory (RESP bulk strings, ``$<len>\\r\\n<bytes>\\r\\n``) for the resp tier's reads in
place: a value whose length is what the caller expects is received into its pieces (a chunk's
header into scratch memory, its layers into a memory object of L1's pool) with no copy in
between; a value of any other length is received whole and returned; a nil is a miss. The
value's length comes from the server, so it is never trusted for an allocation: the tier reads
with ``GETRANGE name 0 <limit>`` and :meth:`BulkReader.bulk_into` refuses a longer reply (a
server out of protocol) before allocating anything for it. redis-py with hiredis
would copy every value twice (into the parser's buffer, then into a new ``bytes``) before the
tier copies it once more, and spends more Python per reply than the round trip costs for a
lookup of 64 keys."""

from __future__ import annotations

import ctypes
import socket
from collections.abc import Sequence

LINE_MAX = 64  # a bulk header line ("$4198400") is far shorter
# A length of more than 12 digits is no value's (Redis values end at 512 MB).


class ProtocolError(ConnectionError):
    """The server sent something a ``GET`` reply cannot be (the connection must be dropped)."""


class BulkReader:
    """Replies of one pipeline, read in order from ``sock`` (its timeout bounds every recv)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()  # received past what was consumed (never more than a line's read)
        self._ahead = LINE_MAX  # how much one read of a line may take (more: no value follows)

    def _recv(self) -> None:
        data = self._sock.recv(self._ahead)
        if not data:
            raise ConnectionError("the server closed the connection in the middle of a reply")
        self._buf += data

    def _line(self) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            if len(self._buf) > LINE_MAX:
                raise ProtocolError(f"reply line too long: {bytes(self._buf[:LINE_MAX])!r}")
            self._recv()
        line = bytes(self._buf[:end])
        del self._buf[: end + 2]
        return line

    def _fill(self, dest: memoryview) -> None:
        """Receive exactly ``len(dest)`` bytes into ``dest``."""
        take = min(len(self._buf), len(dest))
        if take:
            dest[:take] = self._buf[:take]
            del self._buf[:take]
        while take < len(dest):
            got = self._sock.recv_into(dest[take:], len(dest) - take)
            if not got:
                raise ConnectionError("the server closed the connection in the middle of a value")
            take += got

    def bulk_into(self, pieces: Sequence[tuple[int, int]],
                  limit: int | None = None) -> int | bytearray | None:
        """The next reply into ``pieces`` (``(address, nbytes)``, in order): the value's length
        when it filled them exactly; the value itself (a new ``bytearray``) when its length
        differs; ``None`` for a nil or an error reply (a missing or foreign value). With
        ``limit`` (the reply of ``GETRANGE name 0 limit - 1``): an empty reply is a missing
        value, and one longer than ``limit`` a :class:`ProtocolError`, before any allocation."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind in (b"_", b"-"):
            return None
        if kind != b"$" or not (rest.isdigit() or rest == b"-1") or len(rest) > 12:
            raise ProtocolError(f"not a GET reply: {line[:LINE_MAX]!r}")
        n = int(rest)
        if n < 0:
            return None
        if limit is not None and n > limit:
            raise ProtocolError(f"a reply of {n} bytes to a read of at most {limit}")
        out: int | bytearray | None = n
        if limit is not None and n == 0:
            out = None  # GETRANGE of a missing value
        elif n != sum(size for _, size in pieces):
            out = bytearray(n)
            self._fill(memoryview(out))
        else:
            for address, size in pieces:
                self._fill(memoryview((ctypes.c_char * size).from_address(address)).cast("B"))
        end = bytearray(2)
        self._fill(memoryview(end))
        if end != b"\r\n":
            raise ProtocolError(f"a value was followed by {bytes(end)!r}, not its line end")
        return out

    def integer(self) -> bool | None:
        """The next reply as ``EXISTS``'s: whether the key exists; ``None`` for an error."""
        self._ahead = 1 << 16  # integer replies only: read as far as the socket has them
        line = self._line()
        if line[:1] == b"-":
            return None
        if line[:1] != b":" or not line[1:].isdigit() or len(line) > 20:
            raise ProtocolError(f"not an integer reply: {line[:LINE_MAX]!r}")
        return line != b":0"

    def drained(self) -> bool:
        """Whether nothing was received past the last reply (else the stream is out of step)."""
        return not self._buf
