"""Cache keys: what a stored chunk *is* (model, KV dtype, KV layout, TP world/rank, chunk hash).

Two models, dtypes, layouts or TP ranks never share an entry, and the string form of a key uses
only ``[A-Za-z0-9._-]`` so it can be a file or object name without escaping (no ``/``, no ``..``
component can ever be produced, whatever the model name).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import lru_cache

from .errors import ConfigError

_UNSAFE = re.compile(r"[^A-Za-z0-9-]+")
_KEY_RE = re.compile(
    r"^(?P<model>[A-Za-z0-9-]+)\.(?P<dtype>[A-Za-z0-9-]+)\.(?P<layout>[A-Za-z0-9-]+)"
    r"\.tp(?P<ws>[0-9]+)-(?P<rank>[0-9]+)\.(?P<hash>[0-9a-f]+)$"
)
_FIELD_RE = re.compile(r"^[A-Za-z0-9-]+$")


@lru_cache(maxsize=256)
def model_slug(model: str) -> str:
    """A safe, collision-free token for a model name: readable prefix + 8 hex of its sha256."""
    readable = _UNSAFE.sub("-", model).strip("-")[:48] or "model"
    digest = hashlib.sha256(model.encode()).hexdigest()[:8]
    return f"{readable}-{digest}"


@dataclass(frozen=True, slots=True)
class CacheKey:
    """The identity of one stored chunk.

    ``kv_layout`` is a free-form safe token describing how the bytes are laid out (the connector
    uses e.g. ``LBHNC-bs128``, so engines with different block sizes never share pages).
    ``chunk_hash`` is the prefix-chained digest from :class:`kvplug.tokens.TokenDatabase`.
    """

    model: str
    kv_dtype: str
    kv_layout: str
    world_size: int
    rank: int
    chunk_hash: bytes

    def __post_init__(self) -> None:
        for name in ("kv_dtype", "kv_layout"):
            value = getattr(self, name)
            if not _FIELD_RE.match(value):
                raise ConfigError(
                    f"CacheKey.{name}={value!r} must match [A-Za-z0-9-]+ (it becomes part of a "
                    "file name); use e.g. 'bfloat16' or 'LBHNC-bs128'"
                )
        if not (0 <= self.rank < self.world_size):
            raise ConfigError(
                f"CacheKey rank={self.rank} must be in [0, world_size={self.world_size})"
            )
        if not isinstance(self.chunk_hash, bytes) or not self.chunk_hash:
            raise ConfigError(f"CacheKey.chunk_hash must be non-empty bytes, got {self.chunk_hash!r}")

    @property
    def namespace(self) -> str:
        """Everything but the hash: entries of one engine configuration share this prefix."""
        return (
            f"{model_slug(self.model)}.{self.kv_dtype}.{self.kv_layout}"
            f".tp{self.world_size}-{self.rank}"
        )

    @property
    def hex(self) -> str:
        return self.chunk_hash.hex()

    def to_string(self) -> str:
        """Stable, safe string form: ``<model-slug>.<dtype>.<layout>.tp<ws>-<rank>.<hex>``."""
        return f"{self.namespace}.{self.hex}"

    def fields(self) -> dict[str, str]:
        """The key as string fields (what chunk files record in their metadata)."""
        return {
            "model": self.model,
            "kv_dtype": self.kv_dtype,
            "kv_layout": self.kv_layout,
            "world_size": str(self.world_size),
            "rank": str(self.rank),
            "chunk_hash": self.hex,
        }

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> CacheKey:
        """Inverse of :meth:`fields`; raises ``ConfigError`` naming a missing or bad field."""
        try:
            return cls(
                model=fields["model"],
                kv_dtype=fields["kv_dtype"],
                kv_layout=fields["kv_layout"],
                world_size=int(fields["world_size"]),
                rank=int(fields["rank"]),
                chunk_hash=bytes.fromhex(fields["chunk_hash"]),
            )
        except KeyError as exc:
            raise ConfigError(f"cache key field {exc.args[0]!r} is missing from {fields!r}") from None
        except ValueError as exc:
            raise ConfigError(f"cache key fields {fields!r} are malformed: {exc}") from None

    def with_hash(self, chunk_hash: bytes) -> CacheKey:
        return CacheKey(
            self.model, self.kv_dtype, self.kv_layout, self.world_size, self.rank, chunk_hash
        )


def parse_key_string(text: str) -> tuple[str, str]:
    """Split a key string into ``(namespace, hex)``; raises ``ConfigError`` if it is not one.

    The model name itself cannot be recovered from the string (only its slug); chunk files carry
    the full fields in their metadata.
    """
    m = _KEY_RE.match(text)
    if not m:
        raise ConfigError(
            f"{text!r} is not a kvplug key string "
            "(<model-slug>.<dtype>.<layout>.tp<ws>-<rank>.<hex>)"
        )
    return text[: m.start("hash") - 1], m.group("hash")
