"""``kvplug inspect PATH_OR_URL``: what a posix/gds directory or an fsspec store holds.

Chunk files are found anywhere below the root (the tiers write ``root/<2 hex>/<key>.safetensors``)
and told from temporary files by :mod:`kvplug.chunkfile`'s one naming rule; each header is read and
checked by :func:`kvplug.chunkfile.read_header` (local files through ``os.pread``, fsspec URLs
through ranged reads). A local directory may hold what its writers planted: it is walked without
following a link (``os.fwalk``), and only regular files are opened, below the root one directory
at a time, never through a link, never blocking (:mod:`kvplug.chunkfile.beneath`); a link, FIFO
or device named like a chunk is reported, never opened. Names and header fields are printed with
control characters and rich markup escaped. ``--verify`` also reads every layer and checks it with
:func:`kvplug.chunkfile.verify_layer`. With a config (``--config``, else ``$KVPLUG_CONFIG``) that
sets ``auth_key_env``, every header and layer is checked against the deployment's keyring: a
chunk not authenticated under one of its keys is reported, never counted as healthy.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import click
import yaml
from rich.progress import Progress
from rich.table import Table

from .. import chunkfile as cf
from ..chunkfile import beneath
from ..errors import ChunkFormatError
from ..policies.tenants import tenant_of_name
from ..redact import Redactor
from .common import age_of, console, err_console, escape, fail, human_bytes


@dataclass
class FileInfo:
    """One entry of a store's listing."""

    path: str
    size: int
    mtime: float
    regular: bool = True  # a local entry that is a link, a FIFO, a device: never opened


class Store:
    """A read-only view of a chunk store: a local directory, or a root on an fsspec filesystem
    (``auth``: the deployment's keyring, to authenticate every chunk; ``None``: plain chunks)."""

    def __init__(self, target: str, storage_options: dict[str, Any],
                 auth: cf.Keyring | None = None) -> None:
        #: masks the URL's and the storage options' credentials in all it prints
        self.redact = Redactor(target, storage_options)
        self.target = self.redact(target)
        self.auth = auth
        if "://" in target and not target.startswith("file://"):
            try:
                import fsspec
            except ImportError:
                fail("reading a remote store needs fsspec: pip install 'kvplug[remote]'")
            try:
                self.fs, self.root = fsspec.core.url_to_fs(target, **storage_options)
            except (ImportError, ValueError) as exc:
                fail(f"cannot open {self.target}: {self.redact(str(exc))}")
        else:  # a local directory: plain os calls, so inspecting needs no fsspec
            self.fs = None
            self.root = os.path.abspath(target.removeprefix("file://"))
            if not os.path.isdir(self.root):
                fail(f"{target} is not a directory")

    def _listing(self) -> dict[str, dict[str, Any]]:
        if self.fs is not None:
            return self.fs.find(self.root, detail=True)
        out: dict[str, dict[str, Any]] = {}
        for base, _dirs, names, dfd in os.fwalk(self.root, follow_symlinks=False):
            for name in names:
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:  # evicted meanwhile
                    continue
                out[os.path.join(base, name)] = {"size": st.st_size, "mtime": st.st_mtime,
                                                 "regular": stat.S_ISREG(st.st_mode)}
        return out

    def files(self) -> tuple[list[FileInfo], list[FileInfo]]:
        """(chunk files, temporary files) below the root."""
        try:
            listing = self._listing()
        except FileNotFoundError:
            fail(f"{self.target} does not exist")
        except Exception as exc:  # noqa: BLE001 - remote errors: one clear line
            fail(f"cannot list {self.target}: {self.redact.error(exc)}")
        chunks, temps = [], []
        for path, info in sorted(listing.items()):
            name = path.rsplit("/", 1)[-1]
            entry = FileInfo(path, int(info.get("size") or 0), _mtime(info),
                             bool(info.get("regular", True)))
            if cf.is_chunk_file(name):
                chunks.append(entry)
            elif cf.is_temp(name):
                temps.append(entry)
        return chunks, temps

    @contextmanager
    def opened(self, f: FileInfo) -> Iterator[cf.ReadAt]:
        """``read(offset, length)`` over one file: ``os.pread`` on an open descriptor locally,
        ranged reads (clamped to the listed size) on an fsspec filesystem."""
        if self.fs is None:
            fd = beneath.open_below(self.root, os.path.relpath(f.path, self.root))
            try:
                yield lambda offset, length: os.pread(fd, length, offset)
            finally:
                os.close(fd)
            return
        fs = self.fs

        def read(offset: int, length: int) -> bytes:
            end = min(offset + length, f.size)
            return fs.cat_file(f.path, start=offset, end=end) if offset < end else b""

        yield read


def _mtime(info: dict[str, Any]) -> float:
    value = info.get("mtime") or info.get("LastModified") or info.get("created") or 0
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def check_file(store: Store, f: FileInfo, verify: bool) -> tuple[cf.ChunkHeader, str | None]:
    """The file's checked header, and (with ``verify``) which layers fail their checksum, or None.
    Raises ChunkFormatError/OSError/ValueError for a file whose header cannot be read."""
    with store.opened(f) as read:
        header, _ = cf.read_header(read, f.size, store.auth)
        if not verify:
            return header, None
        bad = [i for i in range(header.num_layers)
               if not cf.verify_layer(header, i, read(header.data_offsets[i], header.layer_nbytes))]
    algo = cf.CHECKSUM_ALGO if header.mac is None else cf.MAC_ALGO
    return header, None if not bad else f"layer(s) {bad} fail their {algo} checksum"


@dataclass
class Group:
    """Chunks of one namespace: model (name and namespace digest), dtype, layout, TP and PP."""

    model: str
    model_digest: str
    kv_dtype: str
    kv_layout: str
    tp: str
    pp: str
    codec: str = "-"  # name and settings of the codec the chunks were stored through
    tenant: str = "-"  # the chunks' tenant id (kvplug.policies.tenants), "-" for none
    chunks: int = 0
    tokens: int = 0
    nbytes: int = 0
    oldest: float = field(default=float("inf"))
    newest: float = 0.0


def _checked(store: Store, f: FileInfo, verify: bool) -> tuple[cf.ChunkHeader | None, str | None]:
    if not f.regular:
        return None, "not a regular file (a link, a FIFO or a device): never opened"
    try:
        return check_file(store, f, verify)
    except (ChunkFormatError, OSError, ValueError) as exc:
        return None, f"unreadable header: {exc}"


#: Headers read at once: a directory of a million files is bound by read latency, not CPU.
READ_THREADS = 16


def _read_ahead(pool: ThreadPoolExecutor, store: Store, chunks: list[FileInfo],
                verify: bool) -> Iterator[tuple[cf.ChunkHeader | None, str | None]]:
    """Each file's checked header, in order, with at most ``4 * READ_THREADS`` reads ahead."""
    window: deque[Future] = deque()
    for f in chunks:
        window.append(pool.submit(_checked, store, f, verify))
        if len(window) >= 4 * READ_THREADS:
            yield window.popleft().result()
    while window:
        yield window.popleft().result()


def scan(store: Store, verify: bool) -> dict[str, Any]:
    """Everything ``inspect`` reports, as a dict."""
    chunks, temps = store.files()
    groups: dict[str, Group] = {}
    corrupt: list[dict[str, str]] = []
    tenants: dict[str, dict[str, int]] = {}  # tenant id -> chunks, bytes (from the file names)
    with Progress(console=err_console, transient=True,
                  disable=not err_console.is_terminal) as progress, \
            ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvplug-inspect") as pool:
        task = progress.add_task("verifying" if verify else "reading headers", total=len(chunks))
        for f, (header, problem) in zip(chunks, _read_ahead(pool, store, chunks, verify),
                                        strict=True):
            progress.advance(task)
            use = tenants.setdefault(tenant_of_name(f.path) or "-", {"chunks": 0, "bytes": 0})
            use["chunks"] += 1
            use["bytes"] += f.size
            if problem:
                corrupt.append({"path": f.path, "problem": store.redact(problem)})
                continue
            assert header is not None
            key = header.key
            pp = f"{key.pp_rank}/{key.pp_size}" + (f" L{key.layers}" if key.layers else "")
            codec = _codec_label(header)
            g = groups.setdefault(f"{key.namespace} {codec}", Group(
                key.model, key.model_digest or "-", key.kv_dtype, key.kv_layout,
                f"{key.rank}/{key.world_size}", pp, codec, key.tenant or "-"))
            g.chunks += 1
            g.tokens += header.num_tokens
            g.nbytes += f.size
            g.oldest, g.newest = min(g.oldest, f.mtime), max(g.newest, f.mtime)
    return {
        "root": store.target, "verified": verify,
        "chunks": sum(g.chunks for g in groups.values()),
        "bytes": sum(g.nbytes for g in groups.values()),
        "models": sorted({g.model for g in groups.values()}),
        "groups": [vars(g) for g in groups.values()],
        "tenants": tenants,
        "corrupt": corrupt, "temporary_files": [t.path for t in temps],
    }


def _codec_label(header: cf.ChunkHeader) -> str:
    """``name (package version; k=v, ...)`` of a chunk's codec, ``-`` for raw pages."""
    info = header.codec_info
    if not info:
        return "-"
    params = ", ".join(f"{k}={v}" for k, v in sorted((info.get("params") or {}).items()))
    return f"{info.get('name')} ({info.get('package')} {info.get('version')}; {params})"


def _keyring(config_path: str | None) -> cf.Keyring | None:
    """The keyring of the config's ``auth_key_env`` (a view named ``inspect``), or ``None``."""
    from ..config import load_config, widest_schema
    from ..errors import ConfigError
    from ..storage_manager import auth_keyring

    if config_path is None and not os.environ.get("KVPLUG_CONFIG"):
        return None
    try:
        ring = auth_keyring(load_config(config_path, schema=widest_schema()))
    except ConfigError as exc:
        fail(str(exc))
    return ring.for_tier("inspect") if ring is not None else None


def _parse_options(pairs: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    for n, pair in enumerate(pairs, 1):
        key, sep, value = pair.partition("=")
        if not sep or not key:
            fail(f"--storage-option number {n} is not KEY=VALUE (not shown: it may hold a "
                 "secret)")
        yield key, yaml.safe_load(value)


def _print(report: dict[str, Any]) -> None:
    now = time.time()
    table = Table(title=f"kvplug store {escape(report['root'])}")
    for col in ("Model", "Model digest", "KV dtype", "Layout", "Rank/TP", "Stage/PP", "Codec",
                "Tenant", "Chunks", "Tokens", "Bytes", "Oldest", "Newest"):
        table.add_column(col, overflow="fold")
    for g in report["groups"]:
        table.add_row(*(escape(g[k]) for k in ("model", "model_digest", "kv_dtype", "kv_layout",
                                               "tp", "pp", "codec", "tenant")),
                      str(g["chunks"]), str(g["tokens"]), human_bytes(g["nbytes"]),
                      age_of(g["oldest"], now), age_of(g["newest"], now))
    console.print(table)
    console.print(f"{report['chunks']} chunks, {human_bytes(report['bytes'])} "
                  f"({report['bytes']} bytes), {len(report['models'])} model(s)", highlight=False)
    if set(report["tenants"]) - {"-"}:
        console.print("per tenant (from the object names): " + ", ".join(
            f"{escape(t)} {u['chunks']} chunks {human_bytes(u['bytes'])}"
            for t, u in sorted(report["tenants"].items())), highlight=False)
    if report["temporary_files"]:
        console.print(f"{len(report['temporary_files'])} temporary file(s) (writes in progress, "
                      "or left by a crashed writer)", highlight=False)
    for c in report["corrupt"]:
        console.print(f"[red]corrupt:[/] {escape(c['path'])}: {escape(c['problem'])}", highlight=False,
                      soft_wrap=True)
    if report["verified"] and not report["corrupt"]:
        console.print(f"[green]verified[/]: every checksum of {report['chunks']} chunks matches")


@click.command("inspect")
@click.argument("target", metavar="PATH_OR_URL")
@click.option("--verify", is_flag=True, help="Read every chunk and check every checksum.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option("-s", "--storage-option", "options", multiple=True, metavar="KEY=VALUE",
              help="fsspec storage option (value parsed as YAML), e.g. "
                   "-s 'client_kwargs={endpoint_url: http://127.0.0.1:9000}'.")
@click.option("-c", "--config", "config_path", default=None, metavar="FILE",
              help="kvplug config (default $KVPLUG_CONFIG): with auth_key_env, chunks are "
                   "authenticated with the deployment's secret.")
def inspect_cmd(target: str, verify: bool, as_json: bool, options: tuple[str, ...],
                config_path: str | None) -> None:
    """Show what a posix/gds directory or an fsspec URL holds: chunks, models, bytes, age."""
    store = Store(target, dict(_parse_options(options)), _keyring(config_path))
    report = scan(store, verify)
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
    else:
        _print(report)
    if verify and report["corrupt"]:
        fail(f"{len(report['corrupt'])} corrupt chunk file(s) in {store.target}")
