"""Building the tiers of a :class:`~kvplug.storage_manager.StorageManager` from its configuration.

Split out of :mod:`.storage_manager` (which routes calls to the tiers at run time) because this
runs once, at startup, and owns what a bad configuration is told: :func:`build_tier` starts a
tier's backend with its options validated by the backend's ``Options`` model and wraps it with its
codec; :class:`ScopedHooks` is the one pluggy PluginManager of every tier's plugins, and gives each
tier hook callers that leave out the plugins registered for other tiers (each a
:class:`~kvplug.hook_caller.TierHookCaller`: pluggy's call, prepared once per registration).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import pluggy
from pydantic import BaseModel, ValidationError

from .chunkfile.auth import Keyring
from .codecs.registry import build_codec
from .codecs.wrapper import CodecWrapper, describe_codec
from .config import TierConfig
from .errors import BackendLoadError, ConfigError, KVPlugError
from .hook_caller import TierHookCaller
from .hookspecs import PROJECT, BackendSpec, TierContext, hook_needs
from .memory import MemoryObj
from .plugins import load_backend_class
from .policies.gate import AdmissionGate
from .policies.registry import build_policy, check_policies
from .policies.tenants import TenantQuotas
from .redact import Redactor, describe_validation_error
from .runtime import THREADS, Runtime
from .tier_calls import Tier

logger = logging.getLogger("kvplug.storage")

#: The hooks a tier is called through (each tier gets a caller per hook, see :class:`ScopedHooks`).
HOOKS = tuple(hook_needs(BackendSpec))


def build_tier(index: int, cfg: TierConfig, allocate: Callable[..., MemoryObj | None],
               chunk_size: int, extra: dict[str, Any], runtime: Runtime = THREADS,
               memory_regions: Callable[[], list[tuple[int, int]]] = list,
               read_limit: Callable[[], int | None] = lambda: None,
               auth: Keyring | None = None,
               header_limit: Callable[[], int | None] = lambda: None) -> Tier:
    """Start tier ``index``'s backend (``allocate``, ``memory_regions``, ``read_limit``,
    ``header_limit``: its ``ctx``'s; ``auth``: the deployment's keyring, the tier gets its own view of it) and its codec
    wrapper; a bad option or a backend that fails to start is a clear error naming the tier."""
    check_policies(cfg)
    cls, info = load_backend_class(cfg.backend)
    _check_encrypts(cls, cfg, auth)
    tier_auth = auth.for_tier(cfg.tier_name) if auth is not None else None
    options = _validated_options(cls, cfg)
    ctx = TierContext(
        name=cfg.tier_name,
        options=options,
        allocate=allocate,
        chunk_size=chunk_size,
        extra=dict(extra),
        memory_regions=memory_regions,
        auth=tier_auth,
        read_limit=read_limit,
        header_limit=header_limit,
        eviction=_eviction_policy(cls, cfg, options),
        quotas=None if cfg.quotas is None else TenantQuotas.from_config(cfg.quotas, auth),
        runtime=runtime,
        max_pinned_fraction=cfg.max_pinned_fraction,
    )
    redact = Redactor(cfg.options)
    try:
        backend = cls(ctx)
    except Exception as exc:
        # the message without the tier's secrets; the chained causes only where none holds one
        leaks = _chain_holds_secret(exc, redact)
        if isinstance(exc, KVPlugError) and not leaks:
            raise
        raise (type(exc)(redact(str(exc))) if isinstance(exc, KVPlugError) else BackendLoadError(
            f"tier {cfg.tier_name!r}: backend {cfg.backend!r} from package {info.package} "
            f"failed to start: {redact.error(exc)}")) from (None if leaks else exc)
    tier = None
    try:
        tier = Tier(index, cfg, backend, info.package, runtime)
        tier.auth = tier_auth
        tier.codec = CodecWrapper(tier.name, *codec_of(cfg, tier.never_blocks), allocate)
        if cfg.admission is not None:
            tier.admission = AdmissionGate(
                build_policy("admission", cfg.admission, cfg.tier_name, _capacity(options)),
                cfg.tier_name)
    except BaseException:
        discard_tier(backend, tier, cfg.tier_name)
        raise
    return tier


def discard_tier(backend: Any, tier: Tier | None, name: str) -> None:
    """Release a started backend whose tier never joined a StorageManager (a config error found
    after the start): its ``close`` hook called directly (a failure there is logged: the error
    that brought us here is the one the caller needs), then the tier's threads stopped."""
    close = getattr(backend, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # noqa: BLE001 - logged; the config error goes on to the caller
            logger.warning("tier %r: closing its backend after a failed start failed", name,
                           exc_info=True)
    if tier is not None:
        tier.shutdown()


def _check_encrypts(cls: type, cfg: TierConfig, auth: Keyring | None) -> None:
    """Under ``encrypt: true``, a tier that may block must declare that it stores ciphertext
    (``encrypts``); a ``never_blocks`` tier is process memory and keeps plaintext, as L1 does."""
    if auth is None or not auth.encrypts or getattr(cls, "never_blocks", False) \
            or getattr(cls, "encrypts", False):
        return
    raise ConfigError(
        f"tier {cfg.tier_name!r}: encrypt: true, but backend {cfg.backend!r} does not say it "
        "encrypts what it stores (its class does not set encrypts = True), so its store would "
        "hold plaintext KV; remove the tier, or use a backend that stores chunks through "
        "kvplug.chunkfile with ctx.auth (posix, fsspec, resp, mooncake) and sets encrypts")


def _capacity(options: Any) -> int | None:
    """The tier's ``capacity`` option in bytes, when it has one."""
    raw = options.get("capacity") if isinstance(options, dict) else getattr(options, "capacity", None)
    try:
        return None if raw is None else int(raw)
    except (TypeError, ValueError):
        return None


def _eviction_policy(cls: type, cfg: TierConfig, options: Any) -> Any:
    """The eviction policy for a backend that orders its victims by one (its ``eviction``
    setting, ``lru`` without one); ``None`` for other backends, where the setting is an error."""
    if not getattr(cls, "eviction_policy", False):
        if cfg.quotas is not None and not getattr(cls, "budget_quotas", False):
            raise ConfigError(
                f"tier {cfg.tier_name!r}: backend {cfg.backend!r} picks its own victims (its "
                "store evicts) and does not count its stores per tenant, so it cannot keep "
                "per-tenant quotas; remove quotas, or set them on a tier whose backend sets "
                "eviction_policy = True (local_cpu, posix, gds) or budget_quotas = True "
                "(resp, mooncake, fsspec)")
        if cfg.eviction is not None:
            raise ConfigError(
                f"tier {cfg.tier_name!r}: backend {cfg.backend!r} picks its own victims (its "
                f"store evicts), so eviction: {{policy: {cfg.eviction.policy}}} cannot apply; "
                "remove the eviction setting, or choose a backend whose class sets "
                "eviction_policy = True (local_cpu, posix, gds)")
        return None
    return build_policy("eviction", cfg.eviction, cfg.tier_name, _capacity(options))


def _validated_options(cls: type, cfg: TierConfig) -> Any:
    """The tier's options through the backend's ``Options`` model if it has one, else a dict."""
    model = getattr(cls, "Options", None)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return dict(cfg.options)
    try:
        return model.model_validate(cfg.options)
    except ValidationError as exc:
        redact = Redactor(cfg.options)
        problems = "; ".join(describe_validation_error(e, redact) for e in exc.errors())
        raise ConfigError(
            f"tier {cfg.tier_name!r} (backend {cfg.backend!r}): bad options: {problems}. "
            f"Allowed options: {', '.join(model.model_fields)}"
        ) from None


def codec_of(cfg: TierConfig, never_blocks: bool) -> tuple[Any, Any]:
    """``(codec instance, BackendInfo)`` of a tier's ``codec`` setting, or ``(None, None)``."""
    codec, info = build_codec(cfg, never_blocks)
    if codec is None:
        return None, None
    logger.info("tier %r stores chunks through codec %s", cfg.tier_name,
                describe_codec(codec, info))
    if codec.lossy:
        logger.warning(
            "tier %r: codec %r is LOSSY: KV loaded from this tier approximates what the engine "
            "computed, so outputs after such a hit may differ from a cold run",
            cfg.tier_name, cfg.codec)
    return codec, info


class ScopedHooks:
    """One PluginManager for every tier; each plugin applies to some tiers (or all)."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(BackendSpec)
        self._scope: dict[int, set[str] | None] = {}  # id(plugin) -> tiers it applies to
        self._plugins: dict[int, object] = {}

    def register(self, plugin: object, name: str, tiers: set[str] | None) -> None:
        """Register ``plugin`` for ``tiers`` (every tier if ``None``); :meth:`wire` applies it."""
        self.pm.register(plugin, name=name)
        self._scope[id(plugin)] = tiers
        self._plugins[id(plugin)] = plugin

    def wire(self, tiers: Sequence[Tier]) -> None:
        """Give every tier a caller per hook that leaves out the other tiers' plugins (run again
        after every registration: a tier added, a wrapper added)."""
        for tier in tiers:
            foreign = [
                p for pid, p in self._plugins.items()
                if self._scope[pid] is not None and tier.name not in self._scope[pid]
            ]
            tier.hooks = {h: TierHookCaller(self.pm, h, foreign) for h in HOOKS}


def _chain_holds_secret(exc: BaseException | None, redact: Redactor) -> bool:
    """Whether ``exc`` or an exception it was raised from or during names a secret."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if redact.holds_secret(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
