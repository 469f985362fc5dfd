"""The resp tier on a Valkey/Redis cluster: each master behind a breaker of its own.

A cluster is several stores. When one master is down (crashed, cut off, failing over), the values
in its slots are misses and stores to them are dropped, while every other master keeps serving.
redis-py sends a pipeline to every master its keys live on and raises when any one of them fails,
so the tier's one breaker would then refuse the whole cluster. Here each batch is split by master
(redis-py's slot map, which it keeps current on ``MOVED``), each master's part is one pipeline
behind that master's breaker, and a part that fails or is refused is a miss (``None``) or a failed
store (:class:`~kvplug.backends.common.value_io.Unanswered`) for its values only. While every
master is healthy a batch goes as one pipeline, as before (split only when it fails: a master
that just hung then costs two timeouts, until its breaker opens). The tier's own
breaker hears of it only when no master answers and every master's breaker is open: a cluster
wholly down is refused at once, as a single server is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..common.breaker import CircuitBreaker
from ..common.value_io import Unanswered
from .client import RespIO


class ClusterDown(ConnectionError):
    """No master of the cluster answered (every master's breaker is open)."""


class ClusterRespIO(RespIO):
    """:class:`~.client.RespIO` over a cluster, split by master; ``node_breaker(name)`` makes
    the breaker of one master (the tier's breaker settings)."""

    def __init__(self, *args: Any, node_breaker: Callable[[str], CircuitBreaker],
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._node_breaker = node_breaker
        self._nodes: dict[str, CircuitBreaker] = {}
        self._nodes_lock = threading.Lock()

    def _breaker(self, node: str) -> CircuitBreaker:
        with self._nodes_lock:
            br = self._nodes.get(node)
            if br is None:
                br = self._nodes[node] = self._node_breaker(f"{self.name} master {node}")
            return br

    def _per_node(self, names: Sequence[str], call: Callable[[list[int]], list[Any]],
                  unanswered: Callable[[str], Any]) -> list[Any]:
        """``call(indices)`` (replies for ``names[i]``, one pipeline) per master the names live
        on, behind that master's breaker; ``unanswered(master)`` for the names of a master that
        failed or was refused. Raises :class:`ClusterDown` when no master answered and every
        master's breaker is open. While no master's breaker is open, the whole batch goes first
        as one pipeline (redis-py's, to every master at once); only when that fails is it split,
        and each master's part tried behind its breaker (which tells the failing one apart)."""
        client = self.client()
        with self._nodes_lock:  # the masters now (a replaced master's breaker no longer counts)
            healthy = not any(self._nodes[n.name].is_open for n in client.get_primaries()
                              if n.name in self._nodes)
        if healthy:
            try:
                return call(list(range(len(names))))
            except Exception:  # noqa: BLE001, S110 - which master failed: the split below says
                pass
        groups: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            groups.setdefault(client.get_node_from_key(name).name, []).append(i)
        out: list[Any] = [None] * len(names)
        answered = False
        for node, idx in groups.items():
            br = self._breaker(node)
            replies = None
            if br.allow():
                try:
                    replies = call(idx)
                except Exception as exc:  # noqa: BLE001 - this master's part is a miss
                    self.failed(exc, br)
                else:
                    br.success()
                    answered = True
            for j, i in enumerate(idx):
                out[i] = replies[j] if replies is not None else unanswered(node)
        if not answered and groups and all(
                self._breaker(n.name).is_open for n in client.get_primaries()):
            raise ClusterDown("no master of the cluster answers")
        return out

    def _exists(self, names: Sequence[str]) -> list[bool | None]:
        return self._per_node(names, lambda idx: super(ClusterRespIO, self)._exists(
            [names[i] for i in idx]), lambda _node: None)

    def _get(self, name: str) -> bytes | None:
        return self._per_node([name], lambda _idx: [super(ClusterRespIO, self)._get(name)],
                              lambda _node: None)[0]

    def _get_many(self, names: Sequence[str]) -> list[bytes | None]:
        return self._per_node(names, lambda idx: super(ClusterRespIO, self)._get_many(
            [names[i] for i in idx]), lambda _node: None)

    def _get_range(self, name: str, start: int, end: int) -> bytes | None:
        return self._per_node([name], lambda _idx: [
            super(ClusterRespIO, self)._get_range(name, start, end)], lambda _node: None)[0]

    def _set_many(self, items: Sequence[tuple[str, bytes]]) -> list[BaseException | None]:
        return self._per_node([n for n, _ in items], lambda idx: super(ClusterRespIO, self)
                              ._set_many([items[i] for i in idx]),
                              lambda node: Unanswered(f"master {node} is down"))

    def _delete(self, names: Sequence[str]) -> None:
        def delete(idx: list[int]) -> list[None]:
            super(ClusterRespIO, self)._delete([names[i] for i in idx])
            return [None] * len(idx)

        self._per_node(names, delete, lambda _node: None)

    def stats(self) -> dict[str, float]:
        with self._nodes_lock:
            nodes = list(self._nodes.values())
        return {**super().stats(), "masters_down": float(sum(b.is_open for b in nodes)),
                "master_breaker_trips": float(sum(b.trips for b in nodes))}
