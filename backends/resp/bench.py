"""``kvplug bench``'s raw medium for the ``resp`` tier: redis-py against the tier's server
(:mod:`kvplug.bench_raw`)."""

from __future__ import annotations

from typing import Any

from kvplug.bench_raw import BenchError, RawTarget


class RawRedis(RawTarget):
    """redis-py against the tier's server: ``SET``/``GET``/``EXISTS`` (pipelined for a batch)."""

    def __init__(self, url: str, password: str | None = None) -> None:
        import redis

        super().__init__(f"redis-py {redis.__version__} SET/GET (pipelined for batches)")
        self.client = redis.Redis.from_url(
            url, socket_timeout=30, **({"password": password} if password else {}))
        try:
            self.client.ping()
        except redis.RedisError as exc:
            raise BenchError(f"cannot reach the redis server of the tier: {exc}; check the tier's "
                             "url option and that the server is running") from None

    def _pipe(self, op: str, names: list[str], values: list[Any] | None = None) -> list[Any]:
        if len(names) == 1:
            return [getattr(self.client, op)(names[0], *([values[0]] if values else []))]
        pipe = self.client.pipeline(transaction=False)
        for i, n in enumerate(names):
            getattr(pipe, op)(n, *([values[i]] if values else []))
        return pipe.execute()

    def put(self, names: list[str], parts: list[list[Any]]) -> None:
        self._pipe("set", names, [b"".join(p) for p in parts])

    def get(self, names: list[str]) -> list[Any]:
        return self._pipe("get", names)

    def has(self, names: list[str]) -> list[bool]:
        return [bool(x) for x in self._pipe("exists", names)]

    def delete(self, names: list[str]) -> None:
        self.client.delete(*names)

    def close(self) -> None:
        self.client.close()


__all__ = ["RawRedis"]
