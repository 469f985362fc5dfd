"""The backend contract: pluggy hook specifications every kvplug storage tier implements.

A *backend* is a class. kvplug finds it through the ``kvplug.backends`` entry-point group (or a
``"module:Class"`` path in the config), constructs **one instance per configured tier** as
``Backend(ctx)`` with a :class:`TierContext`, and registers the instance in the
:class:`~kvplug.storage_manager.StorageManager`'s ``pluggy.PluginManager``. Registration validates
every ``@hookimpl`` against the specs below, so a wrong argument name fails at startup with the
backend's name in the error. A minimal backend::

    from kvplug.hookspecs import hookimpl, TierContext

    class DictBackend:
        def __init__(self, ctx: TierContext):
            self.entries = {}

        @hookimpl
        def batched_submit_put(self, keys, objs):
            for key, obj in zip(keys, objs):
                self.entries[key] = bytes(obj.byte_view.numpy())   # copy: do not keep obj

        @hookimpl
        def get(self, key):
            data = self.entries.get(key)
            ...  # allocate with ctx.allocate(...) and fill it, or return None

        @hookimpl
        def contains(self, keys):      # no ``pin``: this tier never pins (else: ``unpin`` too)
            return [k in self.entries for k in keys]

        @hookimpl
        def evict(self, keys, nbytes):
            ...

Each hook below says at its declaration whether a backend must implement it: ``@required``
(``batched_submit_put``, ``get``, ``contains``, ``evict``), ``@optional`` (kvplug does without it,
as its docstring says), or ``@required_with(hook, argument, ...)`` (``unpin``: required when the
backend's ``contains`` takes ``pin``; a class without it loads with a
:class:`~kvplug.errors.BackendContractWarning` naming it, since a tier that takes ``pin`` and
ignores it is fine). The loader reads those markers (:func:`missing_hooks`, :func:`unmet_needs`);
:data:`REQUIRED_HOOKS` is derived from them.

Rules that hold for every hook:

* **Keyword calls, subset of arguments.** kvplug calls hooks with keyword arguments only. An
  implementation may declare any *subset* of a spec's arguments (e.g. ``contains(self, keys)``);
  it may not declare an argument the spec does not have.
* **Per tier, one answer.** The StorageManager calls each tier through hook callers that hold
  only that tier's backend (and the wrappers registered for it), one tier at a time, and decides
  itself which tiers to ask (``allocate``/``get``: in tier order until one answers;
  ``batched_submit_put``, ``contains``, ``evict``, ``stats``...: every tier). So every hook is
  declared ``firstresult``: a call returns the backend's value itself — ``contains`` its list of
  bools, ``evict`` its int, ``stats`` its dict — never a list of answers, and a wrapper
  (``StorageManager.add_wrapper``) receives that same value from its ``yield``. ``None`` (a hook
  that returns nothing, or a tier fault) is read as "no answer": a miss, 0 bytes freed, no
  stats.
* **Misses are not errors.** A missing, evicted, truncated or corrupt entry is a miss: return
  ``None`` / ``False``, log it once, drop or quarantine the bad entry. Never return wrong bytes.
  An exception escaping a hook is treated as a *tier fault*: the StorageManager logs it once,
  counts it in ``stats`` and treats the call as a miss (or a dropped store); serving goes on.
* **Threads and time.** Hooks may be called from several threads at once; guard your own state.
  ``get``, ``batched_get``, ``get_layers`` and ``contains`` run on a StorageManager thread bounded by the tier's
  ``timeout_s`` (a late answer is a miss and its object is released), unless the backend class
  sets ``never_blocks = True`` — a promise that no hook ever waits on I/O (``local_cpu``).
  ``batched_get_nowait`` runs on the caller's thread: it promises never to wait.
* **References** (see :mod:`kvplug.memory`): an object handed *to* a hook is borrowed — call
  ``obj.ref_up()`` to keep it past the call and ``obj.ref_down()`` when done. An object returned
  *from* ``allocate``/``get``/``batched_get``/``get_layers`` carries one reference owned by the caller.
* **Codecs** (see :mod:`kvplug.codecs` and docs/codecs.md): on a tier configured with
  ``codec: NAME``, ``batched_submit_put`` receives ``ENCODED`` objects (``meta.fmt`` is
  ``MemoryFormat.ENCODED``, shape ``[layers, 1, frame_bytes]`` uint8, ``meta.codec`` set) instead
  of ``KV_PAGES`` ones, and their ``nbytes`` is what the tier stores. Store them like any object
  and give back the same ``shape``, ``dtype``, ``fmt`` and ``num_tokens`` from ``get`` /
  ``get_layers`` (allocate with the stored meta, as ``kvplug.chunkfile`` readers do; layer ``i``
  of an ``ENCODED`` object is row ``i``, so ``get_layers`` works unchanged). The codec wrapper
  decodes them; a backend never needs to know about codecs, and L1 always holds raw pages.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import pluggy

from .runtime import THREADS, Runtime

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .chunkfile.auth import Keyring
    from .keys import CacheKey
    from .memory import MemoryFormat, MemoryObj

PROJECT = "kvplug"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: The attribute a hook specification's :class:`Need` is recorded under.
NEED_ATTR = f"{PROJECT}_need"


@dataclass(frozen=True)
class Need:
    """Whether a plugin must implement a hook: declared once, at the hook's specification, by
    :func:`required`, :func:`optional` or :func:`required_with` (the loader reads it there:
    :func:`required_hooks`, :func:`missing_hooks`, :func:`unmet_needs`)."""

    #: the hook must always be implemented
    always: bool
    #: ``(hook, argument)``: the hook must be implemented when the implementation of ``hook``
    #: declares ``argument`` (``unpin`` when ``contains`` takes ``pin``)
    when: tuple[str, str] | None = None
    #: why, for the warning that names a class breaking the rule
    why: str = ""


def _declare(need: Need) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def mark(spec: Callable[..., Any]) -> Callable[..., Any]:
        setattr(spec, NEED_ATTR, need)
        return spec
    return mark


#: A hook every plugin of the spec implements.
required = _declare(Need(always=True))
#: A hook a plugin may leave out (kvplug then does without it, as the hook's docstring says).
optional = _declare(Need(always=False))


def required_with(hook: str, argument: str, why: str) -> Callable[[Callable[..., Any]],
                                                                  Callable[..., Any]]:
    """A hook a plugin implements exactly when its ``hook`` implementation declares
    ``argument`` (otherwise optional); ``why`` goes into the warning naming a class without it
    (:func:`unmet_needs`)."""
    return _declare(Need(always=False, when=(hook, argument), why=why))


def hook_needs(spec: type) -> dict[str, Need]:
    """Every hook of the specification class ``spec``, in declaration order, with its
    :class:`Need`; a hook declared neither required nor optional is a ``TypeError`` (so the
    specs below cannot leave one unsaid: this module fails to import)."""
    needs = {}
    for name, fn in vars(spec).items():
        if not hasattr(fn, f"{PROJECT}_spec"):
            continue
        need = getattr(fn, NEED_ATTR, None)
        if not isinstance(need, Need):
            raise TypeError(f"{spec.__name__}.{name} is declared neither @required nor "
                            "@optional")
        needs[name] = need
    return needs


def required_hooks(spec: type) -> tuple[str, ...]:
    """The hooks of ``spec`` declared :func:`required`, in declaration order."""
    return tuple(name for name, need in hook_needs(spec).items() if need.always)


def missing_hooks(spec: type, implemented: Callable[[str], Sequence[tuple[str, ...]]]
                  ) -> list[str]:
    """The ``@required`` hooks of ``spec`` a plugin does not implement. ``implemented(h)``
    gives the argument names of each of the plugin's implementations of hook ``h`` (none: it
    does not implement ``h``)."""
    return [name for name, need in hook_needs(spec).items()
            if need.always and not implemented(name)]


def unmet_needs(spec: type, implemented: Callable[[str], Sequence[tuple[str, ...]]]
                ) -> list[str]:
    """What a plugin lacks of ``spec``'s :func:`required_with` hooks, one sentence each with
    the fix (``implemented`` as for :func:`missing_hooks`)."""
    unmet = []
    for name, need in hook_needs(spec).items():
        if need.when is None or implemented(name):
            continue
        hook, argument = need.when
        if any(argument in names for names in implemented(hook)):
            unmet.append(f"its {hook} takes {argument!r} but it implements no {name} "
                         f"({need.why}): add an @hookimpl {name}, or drop {argument!r} from "
                         f"{hook}'s arguments if it ignores it")
    return unmet


@dataclass
class TierContext:
    """What a backend's constructor receives.

    Attributes:
        name: the tier's name in the config (unique; e.g. ``"l1"`` or ``"disk"``).
        options: the tier's ``options`` mapping. If the backend class has an ``Options``
            attribute (a pydantic model; derive it from ``kvplug.config.BaseOptions`` to get
            kvplug's rules: unknown keys and booleans given for numbers are errors naming the
            key), it is an instance of that model, validated; otherwise the raw dict.
        allocate: ``allocate(shape, dtype, fmt, num_tokens) -> MemoryObj | None`` — memory for a
            chunk being read, from the fastest tier that owns a pool (so a later promotion into
            L1 is zero-copy), from the heap when none does or when the pool is full (up to the
            config's ``max_heap_fallback`` bytes held at once). ``None`` when memory is full, or
            when the shape does not fit this engine's chunks (the sizes in a stored header are
            the writer's to choose; :mod:`kvplug.read_memory` checks them): treat the read as a
            miss. Call it with the stored meta **before** fetching or allocating anything sized
            by the stored bytes (a body, a layer range), so a header claiming 512 MiB costs
            nothing.
        chunk_size: tokens per chunk (for sizing; chunk objects carry their own token count).
        extra: anything else the host passes (the connector puts ``role``, ``rank``...).
        memory_regions: ``memory_regions() -> [(address, nbytes), ...]`` — the host buffers
            ``allocate`` hands out memory from (an L1 pool; see the ``memory_regions`` hook), for
            a backend whose store reads straight into registered memory (Mooncake, RDMA):
            register them once, then read into what ``allocate`` returns when it lies inside
            them. Memory outside them (a heap fallback when the pool is full) is not registered.
            Empty when no tier owns a pool.
        auth: the deployment's :class:`~kvplug.chunkfile.Keyring` when the config sets
            ``auth_key_env`` (a view for this tier: it counts and logs once the tier's
            authentication failures), else ``None``. A backend that stores chunks through
            ``kvplug.chunkfile`` passes it to every call that takes ``auth`` (``encode_chunk``,
            ``read_header``, ``chunk_name``, ``relative_chunk_path``...): chunks are then
            MAC'd and keyed-named, and one that fails the check raises
            :class:`~kvplug.chunkfile.AuthError` (a ``ChunkFormatError``: a miss; delete it so
            the next store replaces it). With ``encrypt: true`` (``auth.encrypts``) the same
            calls encrypt each layer and ``verify_layers`` decrypts what was read, in place
            (set the class attribute ``encrypts``, see :class:`BackendClass`). Never log it or
            put it in an exception.
        eviction: the tier's eviction policy (:mod:`kvplug.policyspecs`, ``eviction: {policy:
            ...}`` in the tier's config; ``lru`` by default), for a backend whose class sets
            ``eviction_policy = True``: it tells the policy every entry stored, used and removed,
            and evicts the keys ``eviction.victims(nbytes, evictable)`` names, under its own
            lock. ``None`` for other backends (their store picks its victims).
        quotas: the tier's :class:`~kvplug.policies.tenants.TenantQuotas` (its ``quotas``
            setting), for the same backends and those that set ``budget_quotas``, or ``None``: a
            store that would take a tenant (``key.tenant``) past ``quotas.limit(tenant)`` bytes
            first evicts that tenant's own entries (``eviction.victims`` with ``evictable`` true
            only for them), else is skipped; a ``budget_quotas`` tier only skips it.
        read_limit: ``read_limit() -> int | None`` — the most bytes of one stored chunk a tier
            may receive before it can parse the header (a value read whole); a longer value is
            a miss. ``None`` when the host sets no bound.
        header_limit: ``header_limit() -> int | None`` — the most bytes of a stored chunk's
            header a tier may read and parse (a chunk of the engine's layers; pass it as
            ``max_header`` to ``kvplug.chunkfile.read_header``): a longer one is refused after
            its first bytes. ``None``: ``kvplug.chunkfile.MAX_HEADER``.
        runtime: the :class:`kvplug.runtime.Runtime` every thread, pool, event, condition
            wait and clock reading of the backend comes from (``runtime.executor(n, name)``
            for writer or I/O threads, ``daemon=True`` for service threads that must not hold up
            exit; ``runtime.event()``, ``runtime.condition(lock)``, ``runtime.monotonic()``,
            ``runtime.time()`` for wall-clock stamps such as an LRU in file mtimes,
            ``runtime.ticker(fn, interval_s, name)``). Production passes real threads
            (:data:`kvplug.runtime.THREADS`); ``kvplug simulate`` passes the deterministic
            simulation's, which runs every task on one thread when its schedule says so. A
            backend that starts ``threading.Thread`` or sleeps on ``time`` itself still works,
            but the simulation cannot order its work (its seeds may not replay).
        max_pinned_fraction: the share of the tier's capacity an operator's pins
            (``operator_pin``) may hold (the tier's ``max_pinned_fraction`` setting).
    """

    name: str
    options: Any
    allocate: Callable[..., MemoryObj | None]
    chunk_size: int = 256
    extra: dict[str, Any] = field(default_factory=dict)
    memory_regions: Callable[[], list[tuple[int, int]]] = list
    auth: Keyring | None = None
    read_limit: Callable[[], int | None] = lambda: None
    header_limit: Callable[[], int | None] = lambda: None
    eviction: Any = None
    quotas: Any = None
    runtime: Runtime = THREADS
    max_pinned_fraction: float = 0.5


class BackendSpec:
    """The hook specifications. Every hook is documented where it is declared."""

    @optional
    @hookspec(firstresult=True)
    def allocate(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        fmt: MemoryFormat,
        num_tokens: int,
    ) -> MemoryObj | None:
        """Memory for one chunk, from a tier that owns a memory pool (first answer wins).

        Only tiers that own memory implement this (``local_cpu`` owns the host pool; a GDS tier
        may own device memory). Return a fresh :class:`~kvplug.memory.MemoryObj` of ``shape`` and
        ``dtype`` whose single reference belongs to the caller, or ``None`` when the pool is full
        even after evicting what may be evicted. Must not block waiting for memory to free up.
        """

    @optional
    @hookspec(firstresult=True)
    def memory_regions(self) -> list[tuple[int, int]]:
        """For tiers that implement :meth:`allocate`: ``(address, nbytes)`` of each
        host buffer their objects live in (L1's pool), fixed for the tier's life. Other tiers
        receive them as ``ctx.memory_regions()`` to register them with their store's client."""

    @required
    @hookspec(firstresult=True)
    def batched_submit_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        """Store ``objs[i]`` under ``keys[i]`` (called on every tier: write-through); ``keys``
        are distinct within one call.

        ``objs`` are borrowed (``ENCODED`` ones on a tier with a codec: see the module docstring):
        ``ref_up()`` each one you keep past this call (an in-memory tier
        keeps it; a disk or remote tier keeps it until its write is done, then ``ref_down()``).
        **Must not block on I/O**: queue slow writes on your own threads and return. A key already
        stored may be skipped. A store that cannot be done (full, read-only, remote down) is
        dropped, counted in ``stats`` and logged once — never raised into the engine. An entry must
        not become visible to ``contains``/``get`` (here or in another process) before all of its
        bytes are durable enough to be read back whole.
        """

    @required
    @hookspec(firstresult=True)
    def get(self, key: CacheKey) -> MemoryObj | None:
        """The whole chunk stored under ``key``, or ``None`` on a miss.

        The returned object carries one reference owned by the caller (an in-memory tier returns
        its own object after ``ref_up()``: zero-copy; a disk tier reads into memory from
        ``ctx.allocate``). May block on I/O — the StorageManager bounds it with the tier's
        timeout. Verify sizes and checksums before returning: a bad entry is a miss, never bytes.
        """

    @optional
    @hookspec(firstresult=True)
    def batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None] | None:
        """:meth:`get` of several keys in one go (one pipelined round trip, one batch
        call), one answer per key in ``keys``' order (``None``: that key is a miss).

        Every rule of :meth:`get` holds per key (one reference per object, owned by the caller;
        verified before it is returned; a bad entry is a miss). Tiers whose store batches reads
        implement it; for the others :meth:`StorageManager.batched_get
        <kvplug.storage_manager.StorageManager.batched_get>` calls :meth:`get` per key,
        concurrently. The StorageManager hands it at most :data:`~kvplug.tier_calls.BATCH_GET_KEYS`
        keys per call and bounds each call as a whole by the tier's ``timeout_s`` (a late answer
        is a miss for every key, its objects released); a list of another length is a tier
        fault (every key a miss).
        """

    @optional
    @hookspec(firstresult=True)
    def batched_get_nowait(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None] | None:
        """:meth:`batched_get` of what the tier can read **without waiting** on its
        medium — bytes in memory or in the OS page cache, nothing that waits on a device or a
        network (a local file read with ``RWF_NOWAIT``, opened from the kernel's lookup cache)
        — called on the caller's thread, the engine step's included, before any bounded call.

        One answer per key: the object (every rule of :meth:`get`: one reference, the caller's,
        verified), or ``None`` for a key not served so — missing, damaged, or only readable
        with a wait: the StorageManager then asks :meth:`get` / :meth:`batched_get` for those
        keys, bounded by ``timeout_s`` as usual, and that call deals with a bad entry (so this
        one need not: ``None`` and no side effect is right). Its cost must be CPU only (copying
        and verifying bytes already in memory); a tier that cannot promise that leaves it out.
        """

    @optional
    @hookspec(firstresult=True)
    def get_layers(self, key: CacheKey, first_layer: int, num_layers: int) -> MemoryObj | None:
        """Layers ``[first_layer, first_layer + num_layers)`` of a ``KV_PAGES`` (or
        ``ENCODED``) chunk.

        The object's shape is ``[num_layers, blocks, page_bytes]`` and its ``num_tokens`` the
        whole chunk's. Tiers that can read a range cheaply (files with aligned layers, ranged
        object reads) implement it: in layer-wise mode the connector reads a chunk that lookup
        found in such a tier one layer at a time (``num_layers=1``), each just before the engine
        needs that layer; chunks in other tiers are served whole by :meth:`get`. Same rules as
        :meth:`get`: a bad or missing entry is ``None`` (the load fails from that chunk on and
        vLLM recomputes it), never wrong bytes.
        """

    @required
    @hookspec(firstresult=True)
    def contains(self, keys: Sequence[CacheKey], pin: bool) -> list[bool]:
        """For each key, whether this tier holds it now (one ``bool`` per key, same order).

        Must be cheap and side-effect free except for ``pin``: with ``pin=True`` every entry
        answered ``True`` is protected from eviction until :meth:`unpin` is called with its key
        (pins count: pinning twice needs two unpins). Never block on slow I/O longer than the
        tier's timeout; on doubt, answer ``False``.
        """

    @optional
    @hookspec(firstresult=True)
    def forget_misses(self, keys: Sequence[CacheKey]) -> None:
        """Forget any remembered miss of these keys, so the next :meth:`contains` asks the
        store itself. Every tier that remembers misses (a negative cache, a lookup cache)
        implements it. Called before a lookup of chunks another engine announced it is storing
        (disaggregated prefill: the producer's hand-off), which a remembered miss would hide
        until it expires. Cheap; never blocks."""

    @required_with("contains", "pin", "contains(pin=True) takes pins that only unpin releases")
    @hookspec(firstresult=True)
    def unpin(self, keys: Sequence[CacheKey]) -> None:
        """Release one pin (from ``contains(pin=True)``) on each key. Unknown keys are ignored.

        Needed by every tier whose ``contains`` pins: without it a pin is never released, and a
        pinned entry is never evicted. A tier that never pins leaves ``pin`` out of ``contains``
        and needs no ``unpin``; a class whose ``contains`` takes ``pin`` but that has no
        ``unpin`` loads with a :class:`~kvplug.errors.BackendContractWarning` naming the fix."""

    @optional
    @hookspec(firstresult=True)
    def operator_pin(self, keys: Sequence[CacheKey]) -> list[str]:
        """An operator's pin (``kvplug cache pin``): keep each key's entry until
        :meth:`operator_unpin`, exempt from eviction as a lookup's pin is (``evict`` skips it).

        One answer per key: ``"pinned"`` (pinned now, or already pinned by an operator: a second
        pin is no second count), ``"absent"`` (the tier does not hold it), or ``"over_limit"``
        (pinning it would take the bytes pinned by operators past ``ctx.max_pinned_fraction`` of
        the tier's capacity; nothing pinned). Report the bytes
        pinned so in ``stats()`` as ``operator_pinned`` (entries) and ``operator_pinned_bytes``.
        A tier that keeps state across restarts keeps its operator pins too (posix).
        """

    @optional
    @hookspec(firstresult=True)
    def operator_unpin(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Release an operator's pin of each key; ``True`` where one was held."""

    @required
    @hookspec(firstresult=True)
    def evict(self, keys: Sequence[CacheKey] | None, nbytes: int) -> int:
        """Drop entries; return the number of bytes freed.

        With ``keys``: drop those entries (pinned entries and objects a reader still holds are
        skipped). With ``keys=None``: free at least ``nbytes`` under the tier's own policy (e.g.
        LRU), as far as unpinned entries allow. Never raises for unknown keys.
        """

    @optional
    @hookspec(firstresult=True)
    def tenant_usage(self) -> dict[str, int]:
        """Bytes held per tenant id (``key.tenant``; ``""``: chunks without one), for
        tiers that can list their entries (tenants are in every object name, ``.t<16 hex>``).
        Cheap enough for a metrics scrape."""

    @optional
    @hookspec(firstresult=True)
    def evict_tenant(self, tenant: str) -> list[int]:
        """Drop every entry of tenant id ``tenant`` that is not pinned (a shared
        directory's files of other processes included); ``[entries removed, entries left]``.
        Tiers that cannot list their entries (a store that evicts by itself) leave it out: a
        clear by tenant then says "not available" for them."""

    @optional
    @hookspec(firstresult=True)
    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for queued writes; True if none is left."""

    @optional
    @hookspec(firstresult=True)
    def close(self) -> None:
        """Drain queued writes, release every reference and resource. Called once — also when
        the tier is refused right after the backend started (a bad ``codec`` or admission
        setting, an encoder thread that cannot start), before any other hook was called."""

    @optional
    @hookspec(firstresult=True)
    def stats(self) -> dict[str, float]:
        """Counters for logs and metrics (``entries``, ``bytes``, ``dropped_puts``,
        ``corrupt``...). Cheap; called from any thread."""


#: The hooks every backend implements (derived from the markers above; kept for callers that
#: imported it).
REQUIRED_HOOKS: tuple[str, ...] = required_hooks(BackendSpec)


class BackendClass(Protocol):
    """The class-level contract: what kvplug reads from a backend *class* (the hooks above are
    what it calls on an instance). Checked when the class is loaded
    (:func:`class_contract_problems`, from ``kvplug.plugins.validate_backend_class``), so a wrong
    attribute fails at startup with the backend's name, never a tier that quietly misbehaves.

    * ``__init__(ctx)`` — kvplug builds one instance per tier as ``Backend(ctx)``, with one
      :class:`TierContext` and nothing else.

    Optional class attributes (a class may leave any out; the default then applies):

    * ``Options`` — a pydantic model of the tier's ``options`` (derive it from
      ``kvplug.config.BaseOptions``); ``ctx.options`` is then a validated instance of it. Default:
      none, and ``ctx.options`` is the raw dict. Anything else under this name is an error (it
      would otherwise be ignored, and the options never validated).
    * ``never_blocks: bool`` — a promise that no hook ever waits on I/O; kvplug then calls the tier
      on the caller's thread, without the ``timeout_s`` bound, and an engine step may read it
      (``local_cpu``). Default ``False``.
    * ``local_medium: bool`` — the tier reads from a medium on this machine (a local disk, an
      NVMe through GPUDirect Storage): about a millisecond per MiB, never a network round trip.
      A small hit only such a tier holds then loads inside the engine step, within the
      connector's per-step ``in_step_load_bytes``, instead of a step later in the background (the
      call is still bounded by ``timeout_s``). Default ``False``: hits from a tier that may
      block load in the background.
    * ``unbounded: bool`` — the tier keeps no byte count under a ``capacity`` of its own (its store
      bounds itself, e.g. a server with its own eviction), so ``stats()`` has no ``bytes``; the
      conformance kit's capacity test then checks only the tiers beside it. Default ``False``: a
      bounded tier reports ``bytes`` in ``stats()``.
    * ``eviction_policy: bool`` — the tier orders its victims by ``ctx.eviction`` (a pluggable
      eviction policy, :mod:`kvplug.policyspecs`); only such a tier accepts an ``eviction``
      setting in its config. Default ``False``.
    * ``encrypts: bool`` — the tier stores chunks only through :mod:`kvplug.chunkfile` with
      ``ctx.auth`` (``encode_chunk``, ``read_header``, ``verify_layers``), so under the config's
      ``encrypt: true`` what it stores is ciphertext (the library encrypts and decrypts). With
      ``encrypt: true`` a tier that may block and does not set it is refused at startup: its
      store would hold plaintext. A ``never_blocks`` tier (process memory, like L1) keeps
      plaintext. Default ``False``.
    * ``budget_quotas: bool`` — a tier whose store evicts by itself but keeps ``ctx.quotas`` by
      counting the bytes it stores per tenant and skipping a store past its tenant's quota
      (approximate: ``kvplug.backends.common.tenant_budget``); such a tier, or one with
      ``eviction_policy``, accepts a ``quotas`` setting. Default ``False``.
    * ``bench_raw`` / ``bench_no_raw`` — the raw medium under a tier for ``kvplug bench``'s
      tier/raw ratio, or why there is none: declared in :mod:`kvplug.bench_raw`. Default: no
      raw row.

    An instance may also set ``call_bound_s: float`` — the longest one of its hook calls can wait,
    all included: a connection pool's wait, every round trip, a reply that arrives slowly over
    many reads (a socket timeout bounds one read, not a reply), the failures before its breaker
    opens. Where that is within the tier's ``timeout_s``, kvplug calls it on the caller's thread
    instead of handing the call to the tier's pool (:mod:`kvplug.tier_calls`); the tier still
    may block. A bound that leaves any wait out must not be declared. Default: none.

    A subclass turns off a hook its base class implements by setting that name to ``None``
    (``get_layers = None`` in the mooncake tier, whose store has no ranged read): the hook is then
    not implemented, for the loader, the StorageManager and the conformance kit alike. A hook
    declared ``@required`` cannot be turned off (:func:`class_contract_problems` names it).

    Not ``runtime_checkable``: every member but ``__init__`` is optional, so ``isinstance`` could
    not tell a backend class from any other; :func:`class_contract_problems` checks it instead.
    """

    def __init__(self, ctx: TierContext) -> None: ...


#: The optional class attributes of :class:`BackendClass` and their defaults.
CLASS_DEFAULTS: dict[str, Any] = {"Options": None, "never_blocks": False, "local_medium": False,
                                  "unbounded": False, "eviction_policy": False,
                                  "budget_quotas": False, "encrypts": False}


def class_contract_problems(cls: type) -> list[str]:
    """What in ``cls`` breaks the :class:`BackendClass` contract (empty when nothing does)."""
    from pydantic import BaseModel

    problems = []
    model = getattr(cls, "Options", None)
    if model is not None and not (isinstance(model, type) and issubclass(model, BaseModel)):
        problems.append(f"Options is {model!r}, not a pydantic model class: derive it from "
                        "kvplug.config.BaseOptions (or remove it to receive the raw dict)")
    for hook in required_hooks(BackendSpec):
        if hook in dir(cls) and getattr(cls, hook) is None:
            problems.append(f"{hook} = None turns off a required hook; implement it")
    for flag in ("never_blocks", "local_medium", "unbounded", "eviction_policy", "budget_quotas",
                 "encrypts"):
        value = getattr(cls, flag, False)
        if not isinstance(value, bool):
            problems.append(f"{flag} is {value!r}; set it to True or False")
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # a class whose signature Python cannot tell: trust it
        return problems
    try:
        signature.bind(object())
    except TypeError:
        problems.append(f"__init__{signature} cannot be called as Backend(ctx): kvplug passes "
                        "one TierContext and nothing else")
    return problems
