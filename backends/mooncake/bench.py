"""``kvplug bench``'s raw medium for the ``mooncake`` tier: a second Mooncake client of the tier's
master (:mod:`kvplug.bench_raw`)."""

from __future__ import annotations

from typing import Any

from kvplug.bench_raw import BenchError, RawTarget


class RawMooncake(RawTarget):
    """A second Mooncake client of the tier's master (same protocol and sizes): ``upsert`` and
    ``get`` one value at a time, ``batch_is_exist`` for a lookup."""

    def __init__(self, options: Any) -> None:
        from mooncake.store import MooncakeDistributedStore

        super().__init__(f"Mooncake's MooncakeDistributedStore upsert/get ({options.protocol}), "
                         "a second client of the same master")
        self.client = MooncakeDistributedStore()
        rc = self.client.setup(options.local_hostname, options.metadata_server,
                              int(options.global_segment_size), int(options.local_buffer_size),
                              options.protocol, options.device_name, options.master)
        if rc != 0:
            raise BenchError(f"a raw Mooncake client could not reach the master {options.master} "
                             f"(setup returned {rc}); check the tier's master option, or pass "
                             "--no-raw")

    def put(self, names: list[str], parts: list[list[Any]]) -> None:
        for n, p in zip(names, parts):
            rc = self.client.upsert(n, b"".join(p))
            if rc != 0:
                raise RuntimeError(f"Mooncake upsert of {n} returned {rc}")

    def get(self, names: list[str]) -> list[Any]:
        return [self.client.get(n) or None for n in names]

    def has(self, names: list[str]) -> list[bool]:
        return [c == 1 for c in self.client.batch_is_exist(names)]

    def delete(self, names: list[str]) -> None:
        for n in names:
            self.client.remove(n)

    def close(self) -> None:
        self.client.close()


__all__ = ["RawMooncake"]
