"""Cache keys: what a stored chunk *is*; an entry is served only to an engine whose KV it matches.

Fields (every one is in the string form and in a chunk file's header):

* ``model`` + ``model_digest``: the model namespace, from :func:`model_namespace` (below): a
  readable name and a digest of everything about the model that changes KV bytes;
* ``kv_dtype``: the KV cache dtype as the engine configures it, from :func:`kv_dtype_token`
  (tensor dtype, ``cache_dtype`` such as ``fp8_e4m3``/``fp8_e5m2``, and the scale mode);
* ``kv_layout``: how pages are laid out, e.g. ``LBHNC-bs128`` (block size included);
* ``world_size``/``rank``: tensor parallel size and rank;
* ``pp_size``/``pp_rank``/``layers``: pipeline parallel size, rank and this stage's layer range;
* ``chunk_hash``: the prefix-chained token hash (:mod:`kvplug.tokens`), which also covers the
  request-level inputs (LoRA adapter name and path, multimodal inputs, cache salt, prompt
  embeddings);
* ``tenant``: optional, 16 hex of the request's tenant (:func:`kvplug.policies.tenants.tenant_id`
  of its ``cache_salt`` or ``tenant``, never the value itself): whose quota the chunk counts
  against; the last part of the namespace (``.t<16 hex>``), so it is in every object name.

The string form uses only ``[A-Za-z0-9._-]`` so it can be a file or object name without escaping
(no ``/``, no ``..`` component can ever be produced, whatever the model name). Nothing here
imports vLLM: the connector passes plain values.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from .errors import ConfigError

_UNSAFE = re.compile(r"[^A-Za-z0-9-]+")
_KEY_RE = re.compile(
    r"^(?P<model>[A-Za-z0-9-]+)\.(?P<dtype>[A-Za-z0-9-]+)\.(?P<layout>[A-Za-z0-9-]+)"
    r"\.tp(?P<ws>[0-9]+)-(?P<rank>[0-9]+)(?:\.pp[0-9]+-[0-9]+-L[0-9-]*)?(?:\.t[0-9a-f]{16})?"
    r"\.(?P<hash>[0-9a-f]+)$"
)
_FIELD_RE = re.compile(r"^[A-Za-z0-9-]+$")
_DIGEST_RE = re.compile(r"^[0-9a-f]*$")
_LAYERS_RE = re.compile(r"^([0-9]+-[0-9]+)?$")
_TENANT_RE = re.compile(r"^([0-9a-f]{16})?$")
_DEFAULTS = {"model_digest": "", "pp_size": "1", "pp_rank": "0", "layers": "", "tenant": ""}

#: Weight files fingerprinted by :func:`model_source` (names relative to the model directory).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack")
_SAMPLE = 64 * 1024
#: ``hf_config`` entries that say where a config was read from, never what it is.
_PATH_KEYS = frozenset({"_name_or_path", "name_or_path", "_commit_hash", "transformers_version"})


def _digest(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _file_fingerprint(path: Path) -> list[Any]:
    """Size and sha256 of three 64 KiB samples (start, middle, end): finds other weights of the
    same shapes (a fine-tune) without reading gigabytes. Never the path or the mtime."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for off in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
            f.seek(off)
            h.update(f.read(_SAMPLE))
    return [size, h.hexdigest()]


def model_source(model: str, revision: str | None = None) -> dict[str, Any]:
    """Where the weights come from, independent of where they sit on disk.

    A local directory: the digest of its ``config.json`` content and, per weight file (name
    relative to the directory), its size and sampled content. A local file (GGUF): its size and
    sampled content. Anything else is a hub id: the id and the revision.
    """
    p = Path(model)
    if p.is_dir():
        cfg = p / "config.json"
        weights = {str(f.relative_to(p)): _file_fingerprint(f) for f in sorted(p.rglob("*"))
                   if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES)}
        return {"kind": "local", "config": hashlib.sha256(cfg.read_bytes()).hexdigest()
                if cfg.is_file() else "", "weights": weights}
    if p.is_file():
        return {"kind": "file", "weights": _file_fingerprint(p)}
    return {"kind": "hub", "repo": model, "revision": revision or ""}


def model_namespace(source: Mapping[str, Any], settings: Mapping[str, Any],
                    name: str) -> tuple[str, str]:
    """The model namespace: ``(readable name, digest)``; computed here and nowhere else.

    ``source`` says which weights (:func:`model_source`, or ``{"model_name": ...}`` when the
    config's ``model_name`` names the model explicitly); ``settings`` is everything else in the
    engine's model config that changes KV bytes: revision, quantization, served dtype,
    ``hf_overrides``, load format, and the effective HF config (rope scaling, sliding window,
    quantization config...) without the entries that only say where it was read from. ``name``
    is for people only (it is folded into the digest too). The digest is 16 hex of a sha256 over
    a canonical JSON of the three.
    """
    return name, _digest({"source": source, "settings": _strip_paths(settings), "name": name})[:16]


def epoch_digest(model_digest: str, epoch: str) -> str:
    """The model digest of weights changed in place: ``model_digest`` with a weights ``epoch``
    folded in (16 hex, like the digest), or ``model_digest`` itself for the epoch ``""`` (the
    weights on disk). An engine draws a fresh epoch when its weights change
    (``KVPlugConnector.reset_cache``): nothing stored under an earlier one is served to it again,
    while engines still on the old weights keep their entries."""
    if not epoch:
        return model_digest
    return hashlib.sha256(f"{model_digest}\0epoch\0{epoch}".encode()).hexdigest()[:16]


def _strip_paths(value: Any) -> Any:
    """``value`` without the :data:`_PATH_KEYS` entries, at any depth (nested sub-configs)."""
    if isinstance(value, Mapping):
        return {k: _strip_paths(v) for k, v in value.items() if k not in _PATH_KEYS}
    if isinstance(value, list | tuple):
        return [_strip_paths(v) for v in value]
    return value


@lru_cache(maxsize=64)
def kv_dtype_token(tensor_dtype: str, cache_dtype: str = "auto", scales: str = "") -> str:
    """The ``kv_dtype`` key field: the KV tensor dtype, the configured ``cache_dtype`` (fp8,
    fp8_e4m3 and fp8_e5m2 are all uint8 tensors) and the k/v scale mode, as one safe token."""
    parts = [tensor_dtype]
    if cache_dtype not in ("auto", tensor_dtype):
        parts.append(cache_dtype)
    if scales:
        parts.append(scales)
    return _UNSAFE.sub("-", "-".join(parts)).strip("-")


def scale_token(calculate_kv_scales: bool = False, skip_layers: Any = ()) -> str:
    """The k/v scale mode: scales computed at run time and layers left unquantized."""
    parts = ["calcscales"] if calculate_kv_scales else []
    if skip_layers:
        parts.append("skip" + _digest(sorted(str(x) for x in skip_layers))[:8])
    return "-".join(parts)


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
    ``chunk_hash`` is the prefix-chained digest from :class:`kvplug.tokens.TokenDatabase`. The
    fields after it default to "no model digest, no pipeline parallelism" (keys made by hand).
    """

    model: str
    kv_dtype: str
    kv_layout: str
    world_size: int
    rank: int
    chunk_hash: bytes
    model_digest: str = ""
    pp_size: int = 1
    pp_rank: int = 0
    layers: str = ""  # "<first>-<end>" of this pipeline stage, e.g. "0-14"
    tenant: str = ""  # 16 hex of the tenant (kvplug.policies.tenants.tenant_id), or "" for none

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
        if not _DIGEST_RE.match(self.model_digest) or not _LAYERS_RE.match(self.layers):
            raise ConfigError(f"CacheKey model_digest={self.model_digest!r} must be hex and "
                              f"layers={self.layers!r} '<first>-<end>' or empty")
        if not (0 <= self.pp_rank < self.pp_size):
            raise ConfigError(
                f"CacheKey pp_rank={self.pp_rank} must be in [0, pp_size={self.pp_size})"
            )
        if not isinstance(self.chunk_hash, bytes) or not self.chunk_hash:
            raise ConfigError(f"CacheKey.chunk_hash must be non-empty bytes, got {self.chunk_hash!r}")
        if not _TENANT_RE.match(self.tenant):
            raise ConfigError(f"CacheKey.tenant={self.tenant!r} must be 16 hex digits or empty: "
                              "use kvplug.policies.tenants.tenant_id(cache_salt)")

    @property
    def namespace(self) -> str:
        """Everything but the hash: entries of one engine configuration share this prefix."""
        model = model_slug(self.model)
        if self.model_digest:  # the digest covers the name: keep only its readable part
            model = f"{model.rsplit('-', 1)[0]}-{self.model_digest}"
        ns = f"{model}.{self.kv_dtype}.{self.kv_layout}.tp{self.world_size}-{self.rank}"
        if self.pp_size > 1 or self.layers:
            ns += f".pp{self.pp_size}-{self.pp_rank}-L{self.layers}"
        if self.tenant:
            ns += f".t{self.tenant}"
        return ns

    @property
    def hex(self) -> str:
        return self.chunk_hash.hex()

    def to_string(self) -> str:
        """Stable, safe string form:
        ``<model-slug>.<dtype>.<layout>.tp<ws>-<rank>[.pp<size>-<rank>-L<layers>].<hex>``."""
        return f"{self.namespace}.{self.hex}"

    def fields(self) -> dict[str, str]:
        """The key as string fields (what chunk files record in their metadata).

        The identity fields added later (model digest, pipeline stage) are written only when
        set, so a key made by hand encodes exactly as before and its files stay readable.
        """
        out = {
            "model": self.model,
            "kv_dtype": self.kv_dtype,
            "kv_layout": self.kv_layout,
            "world_size": str(self.world_size),
            "rank": str(self.rank),
            "chunk_hash": self.hex,
        }
        extra = {"model_digest": self.model_digest, "pp_size": str(self.pp_size),
                 "pp_rank": str(self.pp_rank), "layers": self.layers, "tenant": self.tenant}
        out.update({k: v for k, v in extra.items() if v != _DEFAULTS[k]})
        return out

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
                model_digest=fields.get("model_digest", ""),
                pp_size=int(fields.get("pp_size", "1")),
                pp_rank=int(fields.get("pp_rank", "0")),
                layers=fields.get("layers", ""),
                tenant=fields.get("tenant", ""),
            )
        except KeyError as exc:
            raise ConfigError(f"cache key field {exc.args[0]!r} is missing from {fields!r}") from None
        except ValueError as exc:
            raise ConfigError(f"cache key fields {fields!r} are malformed: {exc}") from None

    def with_hash(self, chunk_hash: bytes) -> CacheKey:
        return replace(self, chunk_hash=chunk_hash)


def parse_key_string(text: str) -> tuple[str, str]:
    """Split a key string into ``(namespace, hex)``; raises ``ConfigError`` if it is not one.

    The model name itself cannot be recovered from the string (only its slug); chunk files carry
    the full fields in their metadata.
    """
    m = _KEY_RE.match(text)
    if not m:
        raise ConfigError(
            f"{text!r} is not a kvplug key string "
            "(<model-slug>.<dtype>.<layout>.tp<ws>-<rank>[.pp<size>-<rank>-L<layers>].<hex>)"
        )
    return text[: m.start("hash") - 1], m.group("hash")
