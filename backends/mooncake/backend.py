"""The ``mooncake`` tier: chunks as objects in a Mooncake Store, shared by hosts.

All the tier's behaviour (naming, verified loads, batched lookups and stores, pins, eviction,
misses on the store's own eviction or loss) is :class:`~kvplug.backends.common.value_tier.
ValueStoreTier`; this module says how to reach the store: the master's address, the transfer
protocol, how much memory this process lends to the store (``global_segment_size``) and the
client's staging buffer (:mod:`.client`). Mooncake has no ranged read of one object, so this
tier serves whole chunks (no ``get_layers``).
"""

from __future__ import annotations

from kvplug.bench_raw import RawTarget
from kvplug.hookspecs import TierContext
from kvplug.redact import Redactor
from pydantic import ByteSize, Field, field_validator

from ..common.breaker import CircuitBreaker
from ..common.value_io import ValueIO
from ..common.value_tier import ValueStoreOptions, ValueStoreTier
from .client import MooncakeIO


class MooncakeBackend(ValueStoreTier):
    """A remote tier over one Mooncake Store (a master and the segments clients lend it)."""

    kind = "Mooncake store"
    get_layers = None  # MooncakeIO reads no byte ranges: whole chunks only (see BackendClass)

    class Options(ValueStoreOptions):
        master: str = Field(default="", validate_default=True,
                            description="the master's host:port (mooncake_master --rpc_port)")
        local_hostname: str = Field(default="127.0.0.1",
                                    description="this host's address as peers reach it")
        protocol: str = Field(default="tcp", description="transfer protocol: tcp or rdma")
        device_name: str = Field(default="", description="RDMA device(s); empty for tcp")
        metadata_server: str = Field(default="P2PHANDSHAKE",
                                     description="P2PHANDSHAKE (no etcd) or an etcd/http URL")
        global_segment_size: ByteSize = Field(
            default=ByteSize(256 << 20), ge=0, description="memory this process lends to the "
            "store (objects in it vanish with the process); 0 with dedicated storage processes")
        local_buffer_size: ByteSize = Field(default=ByteSize(128 << 20), gt=0,
                                            description="the client's staging buffer")
        setup_retries: int = Field(default=1, ge=1,
                                   description="tries to reach the master per setup")

        @field_validator("master")
        @classmethod
        def _master_given(cls, v: str) -> str:
            host, _, port = v.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"master {v!r} should be host:port, e.g. '127.0.0.1:50051'")
            return v

        @field_validator("protocol")
        @classmethod
        def _protocol_known(cls, v: str) -> str:
            if v not in ("tcp", "rdma"):
                raise ValueError(f"protocol {v!r} is not 'tcp' or 'rdma'")
            return v

    @staticmethod
    def bench_raw(options: MooncakeBackend.Options) -> RawTarget:
        """``kvplug bench``'s raw medium (:mod:`kvplug.bench_raw`): a second Mooncake client of
        the same master (.bench.RawMooncake)."""
        from .bench import RawMooncake

        return RawMooncake(options)

    def open_io(self, ctx: TierContext, breaker: CircuitBreaker) -> tuple[ValueIO, str]:
        opts: MooncakeBackend.Options = ctx.options
        shown = f"mooncake://{opts.master} ({opts.protocol})"
        return MooncakeIO(ctx.name, opts, breaker, Redactor(opts.model_dump()),
                          ctx.memory_regions, ctx.runtime), shown
